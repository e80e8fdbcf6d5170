mod child;

pub struct P;

/// The edge into `child`: a parent names its own module without `self::`.
pub fn start() -> u32 {
    child::run()
}
