use crate::{
    m as _,
    top::{self, Top},
};

pub struct O;

pub fn back() -> Option<Top> {
    let _ = top::Top;
    None
}
