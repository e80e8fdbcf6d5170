use proptest::prelude::*;

use super::*;

const ROLE: &str = r#"data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#;
const TOKEN: &str = r#"data: {"choices":[{"index":0,"delta":{"content":"Paris"}}]}"#;
const TOOL: &str = r#"data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"f"}}]}}]}"#;
const FINISH: &str = r#"data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#;
const USAGE_ONLY: &str =
    r#"data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}"#;
/// llama.cpp's last `/v1/completions` chunk: a choice and the usage together.
const USAGE_IN_CHOICE: &str = r#"data: {"choices":[{"text":"","index":0,"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":9,"total_tokens":14}}"#;
const DONE: &str = "data: [DONE]";

/// Feeds `wire` cut at `cuts`; returns what went on and, per piece, the first-output flag.
fn run(scan: &mut EventScan, wire: &[u8], cuts: &[usize]) -> (Vec<u8>, Vec<bool>) {
    let mut ends: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
    ends.push(wire.len());
    ends.sort_unstable();
    let (mut out, mut firsts, mut at) = (Vec::new(), Vec::new(), 0);
    for end in ends {
        let piece = Bytes::copy_from_slice(&wire[at..end.max(at)]);
        at = end.max(at);
        let scanned = scan.feed(piece);
        out.extend_from_slice(&scanned.out.unwrap_or_default());
        firsts.push(scanned.first_output);
    }
    let last = scan.finish();
    out.extend_from_slice(&last.out.unwrap_or_default());
    firsts.push(last.first_output);
    (out, firsts)
}

fn stream(events: &[&str], eol: &str) -> String {
    events.iter().map(|e| format!("{e}{eol}{eol}")).collect()
}

#[test]
fn events_end_at_an_empty_line_with_any_line_ending() {
    for (wire, expected) in [
        ("data: a\n\ndata: b\n\n", vec![9, 18]),
        ("data: a\r\n\r\ndata: b\r\n\r\n", vec![11, 22]),
        ("data: a\r\rdata: b\r\r", vec![9, 18]),
        ("event: x\ndata: a\n\n: ping\n\n", vec![18, 26]),
        ("data: a\r\n\ndata: b\n\r\n", vec![10, 20]),
    ] {
        let mut ends = EventEnds::default();
        let mut found = Vec::new();
        let mut from = 0;
        while let Some(end) = ends.next_end(wire.as_bytes(), from) {
            found.push(end);
            from = end;
        }
        // A trailing lone CR is confirmed only by the next byte, or by the stream's end.
        if ends.state == Line::EmptyCr {
            found.push(wire.len());
        }
        assert_eq!(found, expected, "{wire:?}");
    }
}

#[test]
fn crlf_events_go_on_one_by_one_and_usage_events_are_cut() {
    let mut scan = EventScan::new(true);
    let mut firsts = Vec::new();
    for event in [ROLE, TOKEN, FINISH, USAGE_ONLY, DONE] {
        let wire = format!("{event}\r\n\r\n");
        let scanned = scan.feed(Bytes::from(wire.clone()));
        firsts.push(scanned.first_output);
        match event {
            USAGE_ONLY => assert!(scanned.out.is_none()),
            // Passed on whole and uncopied, as soon as it ended.
            _ => assert_eq!(scanned.out.unwrap(), wire),
        }
    }
    assert_eq!(firsts, [false, true, false, false, false]);
    assert_eq!(
        scan.usage,
        Some(Usage {
            prompt_tokens: 7,
            completion_tokens: 3
        })
    );
    assert!(scan.pending.is_empty());
}

#[test]
fn usage_inside_a_choice_chunk_is_counted_and_passed_on() {
    let wire = stream(&[TOKEN, USAGE_IN_CHOICE, DONE], "\n");
    for strip in [true, false] {
        let mut scan = EventScan::new(strip);
        let (out, _) = run(&mut scan, wire.as_bytes(), &[]);
        assert_eq!(out, wire.as_bytes());
        if strip {
            assert_eq!(
                scan.usage,
                Some(Usage {
                    prompt_tokens: 5,
                    completion_tokens: 9
                })
            );
        }
    }
}

#[test]
fn a_tool_call_is_output_and_a_role_chunk_is_not() {
    let mut scan = EventScan::new(false);
    let (_, firsts) = run(
        &mut scan,
        stream(&[ROLE, FINISH, TOOL, TOKEN], "\n").as_bytes(),
        &[100, 200, 300],
    );
    assert_eq!(firsts.iter().filter(|f| **f).count(), 1);
    let mut scan = EventScan::new(false);
    let (_, firsts) = run(
        &mut scan,
        stream(&[ROLE, FINISH, DONE], "\n").as_bytes(),
        &[],
    );
    assert!(firsts.iter().all(|f| !f));
}

#[test]
fn an_event_that_never_ends_is_passed_on_not_held() {
    let mut scan = EventScan::new(true);
    let line = format!("data: {}", "x".repeat(1000));
    let mut sent = 0;
    for _ in 0..200 {
        let scanned = scan.feed(Bytes::from(line.clone()));
        sent += scanned.out.map_or(0, |b| b.len());
        assert!(scan.pending.len() <= MAX_EVENT);
    }
    assert!(sent >= 200 * 1000 - MAX_EVENT, "{sent}");
    // The stream goes on normally after it.
    let scanned = scan.feed(Bytes::from(format!("\n\n{USAGE_ONLY}\n\n{TOKEN}\n\n")));
    let out = scanned.out.unwrap();
    assert!(out.starts_with(b"\n\n") && !out.windows(7).any(|w| w == b"\"usage\""));
}

proptest! {
    #[test]
    fn any_split_of_any_line_ending_gives_the_same_stream(
        kinds in prop::collection::vec(0usize..6, 1..12),
        eol in prop::sample::select(vec!["\n", "\r\n", "\r"]),
        strip in any::<bool>(),
        cuts in prop::collection::vec(any::<usize>(), 0..16),
    ) {
        let all = [ROLE, TOKEN, FINISH, USAGE_ONLY, USAGE_IN_CHOICE, ": keep-alive"];
        let events: Vec<&str> = kinds.iter().map(|k| all[*k]).collect();
        let wire = stream(&events, eol);
        let expected: String = events
            .iter()
            .filter(|e| !(strip && **e == USAGE_ONLY))
            .map(|e| format!("{e}{eol}{eol}"))
            .collect();
        let mut scan = EventScan::new(strip);
        let (out, firsts) = run(&mut scan, wire.as_bytes(), &cuts);
        prop_assert_eq!(String::from_utf8(out).unwrap(), expected);
        let outputs = events.contains(&TOKEN);
        prop_assert_eq!(firsts.iter().filter(|f| **f).count(), usize::from(outputs));
        if strip {
            let last_usage = events.iter().rev().find_map(|e| match *e {
                USAGE_ONLY => Some((7, 3)),
                USAGE_IN_CHOICE => Some((5, 9)),
                _ => None,
            });
            prop_assert_eq!(scan.usage.map(|u| (u.prompt_tokens, u.completion_tokens)), last_usage);
        }
    }
}

proptest! {
    /// Output events are counted the same however the stream is cut, stripped or not; the
    /// closing `[DONE]` never counts, nor a usage event cut out.
    #[test]
    fn data_events_count_the_same_for_every_split(
        cuts in proptest::collection::vec(0usize..4096, 0..12),
        strip in any::<bool>(),
        crlf in any::<bool>(),
    ) {
        let mut events = vec![ROLE];
        events.extend([TOKEN; 5]);
        events.extend([FINISH, USAGE_ONLY, DONE]);
        let wire = stream(&events, if crlf { "\r\n" } else { "\n" });
        let mut scan = EventScan::new(strip);
        run(&mut scan, wire.as_bytes(), &cuts);
        // Role, five tokens and finish; the usage event too when it went on.
        prop_assert_eq!(scan.data_events, if strip { 7 } else { 8 });
    }
}
