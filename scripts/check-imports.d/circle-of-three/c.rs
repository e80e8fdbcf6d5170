pub struct C;

/// The edge back to `a` that closes the circle.
pub fn inner(a: crate::a::A) -> C {
    (a.0).0
}
