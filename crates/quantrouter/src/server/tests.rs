//! The hand-written header formatters against the `format!` they replace.

use proptest::prelude::*;

use crate::app::request_id;
use crate::pipeline::complexity_header;
use http::HeaderValue;

fn text(value: &HeaderValue) -> &str {
    value.to_str().expect("ASCII header value")
}

#[test]
fn complexity_is_written_as_three_decimals() {
    // Ties of the decimal expansion go to the formatter (0.0625 is exact in binary and
    // rounds half to even there), as do scores outside [0, 1].
    for score in [
        0.0, 1.0, 0.5, 0.0625, 0.0005, 0.1235, 0.9995, 0.999_96, 1e-9, -0.0, -0.25, 1.5,
    ] {
        let header = complexity_header(score).expect("a header value");
        assert_eq!(text(&header), format!("{score:.3}"), "score {score}");
    }
}

#[test]
fn request_ids_are_prefix_and_counter_in_hex() {
    for (prefix, n) in [(0, 0), (0xdead_beef, 1), (7, 0xff), (u32::MAX, u64::MAX)] {
        let id = request_id(prefix, n);
        assert_eq!(text(&id), format!("qr-{prefix:08x}-{n:x}"));
    }
}

proptest! {
    #[test]
    fn complexity_matches_the_formatter(score in 0.0f64..=1.0) {
        let header = complexity_header(score).expect("a header value");
        prop_assert_eq!(text(&header), format!("{score:.3}"));
    }

    #[test]
    fn complexity_matches_the_formatter_near_ties(milli in 0u32..1000, offset in -1e-6f64..1e-6) {
        let score = (f64::from(milli) + 0.5) / 1000.0 + offset;
        let header = complexity_header(score).expect("a header value");
        prop_assert_eq!(text(&header), format!("{score:.3}"));
    }

    #[test]
    fn request_id_matches_the_formatter(prefix in any::<u32>(), n in any::<u64>()) {
        let id = request_id(prefix, n);
        prop_assert_eq!(text(&id), format!("qr-{prefix:08x}-{n:x}"));
    }
}
