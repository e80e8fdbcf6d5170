use crate::other::O;

pub fn run() -> u32 {
    let _ = O;
    0
}
