// top -> m/inner (through m's re-export) -> other (super::super) -> top (nested braces).
pub mod m;
pub mod other;
pub mod top;
