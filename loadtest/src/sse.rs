//! Just enough server-sent-events parsing to time a stream: when the first content arrives,
//! whether the stream ended with `[DONE]`, and whether it carried an error event.

/// Incremental scanner over a `text/event-stream` body; frames may split lines anywhere.
#[derive(Debug, Default)]
pub struct SseScanner {
    partial: Vec<u8>,
    content_seen: bool,
    done_seen: bool,
    error_seen: bool,
}

// === impl SseScanner ===

impl SseScanner {
    /// Feeds one body frame.
    pub fn feed(&mut self, chunk: &[u8]) {
        for piece in chunk.split_inclusive(|byte| *byte == b'\n') {
            if !piece.ends_with(b"\n") {
                self.partial.extend_from_slice(piece);
            } else if self.partial.is_empty() {
                self.on_line(piece);
            } else {
                self.partial.extend_from_slice(piece);
                let line = std::mem::take(&mut self.partial);
                self.on_line(&line);
                // Hand the allocation back for the next split line.
                self.partial = line;
                self.partial.clear();
            }
        }
    }

    /// A `data:` chunk with non-empty generated text has been seen.
    pub fn content_seen(&self) -> bool {
        self.content_seen
    }

    /// The `data: [DONE]` terminator has been seen.
    pub fn done_seen(&self) -> bool {
        self.done_seen
    }

    /// A `data:` chunk with a top-level `error` has been seen.
    pub fn error_seen(&self) -> bool {
        self.error_seen
    }

    fn on_line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let data = data.strip_prefix(b" ").unwrap_or(data);
        if data == b"[DONE]" {
            self.done_seen = true;
            return;
        }
        if self.content_seen {
            // After the first token only errors matter, and a substring test is cheaper than
            // parsing: the key `"error":` cannot come from generated text, where JSON escapes
            // every quote.
            if contains(data, b"\"error\":") {
                self.error_seen = true;
            }
            return;
        }
        let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
            return;
        };
        if value.get("error").is_some() {
            self.error_seen = true;
        } else if carries_content(&value) {
            self.content_seen = true;
        }
    }
}

/// Whether a chunk has generated text: chat `delta.content` or completions `text`.
fn carries_content(chunk: &serde_json::Value) -> bool {
    let Some(choices) = chunk.get("choices").and_then(serde_json::Value::as_array) else {
        return false;
    };
    choices.iter().any(|choice| {
        let text = choice
            .get("delta")
            .and_then(|delta| delta.get("content"))
            .or_else(|| choice.get("text"));
        text.and_then(serde_json::Value::as_str)
            .is_some_and(|text| !text.is_empty())
    })
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROLE: &str = "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n";
    const TOKEN: &str = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n";
    const USAGE: &str = "data: {\"choices\":[],\"usage\":{\"completion_tokens\":1}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    #[test]
    fn role_chunk_is_not_content_but_first_token_is() {
        let mut scanner = SseScanner::default();
        scanner.feed(ROLE.as_bytes());
        assert!(!scanner.content_seen());
        scanner.feed(TOKEN.as_bytes());
        assert!(scanner.content_seen());
        scanner.feed(USAGE.as_bytes());
        assert!(!scanner.done_seen());
        scanner.feed(DONE.as_bytes());
        assert!(scanner.done_seen());
        assert!(!scanner.error_seen());
    }

    #[test]
    fn lines_split_across_frames_are_reassembled() {
        let whole = format!("{ROLE}{TOKEN}{DONE}");
        for split in 1..whole.len() {
            let mut scanner = SseScanner::default();
            let (head, tail) = whole.as_bytes().split_at(split);
            scanner.feed(head);
            scanner.feed(tail);
            assert!(scanner.content_seen(), "split at {split}");
            assert!(scanner.done_seen(), "split at {split}");
        }
    }

    #[test]
    fn completions_text_counts_as_content() {
        let mut scanner = SseScanner::default();
        scanner.feed(b"data: {\"choices\":[{\"text\":\"\"}]}\r\n\r\n");
        assert!(!scanner.content_seen());
        scanner.feed(b"data:{\"choices\":[{\"text\":\" x\"}]}\r\n\r\n");
        assert!(scanner.content_seen());
    }

    #[test]
    fn error_events_are_noticed_before_and_after_content() {
        let mut before = SseScanner::default();
        before.feed(b"data: {\"error\":{\"message\":\"boom\"}}\n\n");
        assert!(before.error_seen());
        assert!(!before.content_seen());

        let mut after = SseScanner::default();
        after.feed(TOKEN.as_bytes());
        after.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"say \\\"error\\\"\"}}]}\n\n");
        assert!(!after.error_seen());
        after.feed(b"data: {\"error\":{\"message\":\"upstream reset\"}}\n\n");
        assert!(after.error_seen());
    }
}
