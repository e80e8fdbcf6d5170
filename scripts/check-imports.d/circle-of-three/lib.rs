// a -> b -> c -> a: three files in one circle.
pub mod a;
pub mod b;
pub mod c;
