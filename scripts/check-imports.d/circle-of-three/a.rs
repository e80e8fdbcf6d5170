use crate::b::B;

pub struct A(pub B);
