mod inner;

pub use inner::T;
