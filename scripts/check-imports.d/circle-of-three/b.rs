pub struct B(pub crate::c::C);
