// parent -> child (a bare path, no `use`) -> other -> parent: three files in one circle.
pub mod other;
pub mod parent;
