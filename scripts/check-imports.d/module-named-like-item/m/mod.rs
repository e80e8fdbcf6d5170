pub mod document;
pub mod train;

pub use train::train;

pub const CLASSES: usize = 5;
