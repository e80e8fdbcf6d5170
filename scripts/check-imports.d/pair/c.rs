use crate::a::A;

pub struct C(pub A);
