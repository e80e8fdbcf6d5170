//! The admission wait queue against a plain model: served by priority then arrival, never
//! over capacity, and a full queue refuses or displaces only the lowest priority.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use proptest::prelude::*;
use quantrouter_policy::wait_queue::{Place, Push, WaitQueue};

#[derive(Debug, Clone)]
enum Op {
    Push(i32),
    Pop,
    /// Remove the n-th place handed out (if it is still waiting).
    Remove(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (-2i32..3).prop_map(Op::Push),
        2 => Just(Op::Pop),
        1 => any::<usize>().prop_map(Op::Remove),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn serves_higher_priority_first_and_fifo_within_one(
        capacity in 0usize..8,
        ops in prop::collection::vec(op(), 0..200),
    ) {
        let mut queue = WaitQueue::new(capacity);
        // The model: (priority, arrival) of each waiter, the waiter's id being its arrival.
        let mut model: Vec<(i32, u64)> = Vec::new();
        let mut places: Vec<(Place, u64)> = Vec::new();
        let mut next_id = 0u64;
        for op in ops {
            match op {
                Op::Push(priority) => {
                    let id = next_id;
                    next_id += 1;
                    let lowest = model
                        .iter()
                        .min_by_key(|(p, arrival)| (*p, std::cmp::Reverse(*arrival)))
                        .copied();
                    match queue.push(priority, id) {
                        Push::Queued(place) => {
                            prop_assert!(model.len() < capacity);
                            model.push((priority, id));
                            places.push((place, id));
                        }
                        Push::Displaced { place, displaced } => {
                            prop_assert_eq!(model.len(), capacity);
                            let (low_priority, low_id) = lowest.unwrap();
                            prop_assert!(low_priority < priority);
                            prop_assert_eq!(displaced, low_id, "the newest of the lowest priority goes");
                            model.retain(|(_, a)| *a != low_id);
                            model.push((priority, id));
                            places.push((place, id));
                        }
                        Push::Refused(back) => {
                            prop_assert_eq!(back, id);
                            prop_assert_eq!(model.len(), capacity);
                            prop_assert!(lowest.is_none_or(|(p, _)| p >= priority));
                        }
                    }
                }
                Op::Pop => {
                    let expected = model
                        .iter()
                        .max_by_key(|(p, arrival)| (*p, std::cmp::Reverse(*arrival)))
                        .copied();
                    let got = queue.pop();
                    prop_assert_eq!(got.as_ref().map(|(_, id)| *id), expected.map(|(_, a)| a));
                    if let Some((place, _)) = got {
                        prop_assert_eq!(Some(place.priority()), expected.map(|(p, _)| p));
                    }
                    if let Some((_, id)) = expected {
                        model.retain(|(_, a)| *a != id);
                    }
                }
                Op::Remove(n) => {
                    if places.is_empty() {
                        continue;
                    }
                    let (place, id) = places[n % places.len()];
                    let waiting = model.iter().any(|(_, a)| *a == id);
                    prop_assert_eq!(queue.remove(place), waiting.then_some(id));
                    model.retain(|(_, a)| *a != id);
                }
            }
            prop_assert_eq!(queue.len(), model.len());
            prop_assert!(queue.len() <= capacity);
        }
    }
}
