pub struct C;

pub fn make() -> crate::a::A {
    todo!()
}
