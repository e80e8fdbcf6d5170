use crate::m::T;

pub struct Top(pub T);
