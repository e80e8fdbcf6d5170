//! What a queue scrape ([`crate::probes::scrape`]) found on an endpoint's metrics page: the
//! plain data the endpoint keeps and routing reads, with the servers whose names it knows.

/// The queue metrics of one kind of server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueNames {
    pub server: &'static str,
    /// Requests waiting to start.
    pub waiting: &'static str,
    /// Requests being generated.
    pub running: &'static str,
}

/// The servers people run behind a router, in the order detection tries them.
pub const KNOWN: [QueueNames; 4] = [
    QueueNames {
        server: "vllm",
        waiting: "vllm:num_requests_waiting",
        running: "vllm:num_requests_running",
    },
    QueueNames {
        server: "sglang",
        waiting: "sglang:num_queue_reqs",
        running: "sglang:num_running_reqs",
    },
    QueueNames {
        server: "llamacpp",
        waiting: "llamacpp:requests_deferred",
        running: "llamacpp:requests_processing",
    },
    QueueNames {
        server: "tgi",
        waiting: "tgi_queue_size",
        running: "tgi_batch_current_size",
    },
];

/// Whose queue metrics an endpoint's page had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueSource {
    /// Not scraped yet, or every scrape failed to connect.
    Unknown,
    /// One of [`KNOWN`], by index.
    Known(usize),
    /// The names the profile sets.
    Configured,
    /// The page had no queue metric the router reads (or there was no page).
    Missing,
}

/// What one scrape found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueReading {
    pub waiting: Option<u64>,
    pub running: Option<u64>,
    pub source: QueueSource,
}

// === impl QueueSource ===

impl QueueSource {
    pub(crate) fn as_byte(self) -> u8 {
        match self {
            Self::Unknown => 0,
            // KNOWN has four entries.
            Self::Known(i) => 1 + i as u8,
            Self::Configured => 100,
            Self::Missing => 101,
        }
    }

    pub(crate) fn from_byte(byte: u8) -> Self {
        match byte {
            0 => Self::Unknown,
            100 => Self::Configured,
            101 => Self::Missing,
            i => Self::Known(usize::from(i - 1).min(KNOWN.len() - 1)),
        }
    }

    /// The page had a queue metric the router reads; `None` before the first page.
    pub fn found(self) -> Option<bool> {
        match self {
            Self::Unknown => None,
            Self::Known(_) | Self::Configured => Some(true),
            Self::Missing => Some(false),
        }
    }
}
