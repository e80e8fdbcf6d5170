pub struct B;

/// Built with [`crate::c::C`] in mind.
pub fn a() -> crate::a::A {
    let _ = "crate::c::C";
    crate::a::A
}

#[cfg(test)]
mod tests {
    use crate::c::C;
}
