//! What the gateway changes in a request body before it goes upstream.

/// What the gateway changes in a body, each a range of it replaced,
/// applied in the order of their ranges.
#[derive(Default)]
pub struct Edits(Vec<(std::ops::Range<usize>, Vec<u8>)>);

impl Edits {
    /// `value` (a slice of `body`: a member's raw value) replaced by the
    /// JSON string `with`.
    pub fn string_at(&mut self, body: &[u8], value: &[u8], with: &str) {
        let start = value.as_ptr() as usize - body.as_ptr() as usize;
        let mut json = Vec::with_capacity(with.len() + 2);
        // Writing a string to a Vec cannot fail.
        let _ = serde_json::to_writer(&mut json, with);
        self.0.push((start..start + value.len(), json));
    }

    /// `bytes` written at offset `at`.
    pub fn insert(&mut self, at: usize, bytes: Vec<u8>) {
        self.0.push((at..at, bytes));
    }

    /// The body with every edit made, `None` when there are none.
    pub fn apply(mut self, body: &[u8]) -> Option<Vec<u8>> {
        if self.0.is_empty() {
            return None;
        }
        self.0.sort_by_key(|(r, _)| r.start);
        let added: usize = self.0.iter().map(|(_, b)| b.len()).sum();
        let mut out = Vec::with_capacity(body.len() + added);
        let mut at = 0;
        for (range, bytes) in &self.0 {
            out.extend_from_slice(&body[at..range.start]);
            out.extend_from_slice(bytes);
            at = range.end;
        }
        out.extend_from_slice(&body[at..]);
        Some(out)
    }
}
