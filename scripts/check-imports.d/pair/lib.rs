// a <-> b is a pair; c -> a closes no circle. Comments, strings and test code name c's
// paths, which are no edges: crate::c::C.
pub mod a;
pub mod b;
pub mod c;
