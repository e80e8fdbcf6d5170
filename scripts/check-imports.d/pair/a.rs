use crate::b::B;

pub struct A;

pub fn both() -> (A, B) {
    (A, B)
}
