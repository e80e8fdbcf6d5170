use super::super::other::O as Other;

pub struct T(pub Other);
