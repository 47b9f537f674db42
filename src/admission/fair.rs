//! Weighted fair queueing among tenants at one backend ([`Fair`]): each
//! request gets a virtual start tag, no earlier than its tenant's last
//! finish nor than the virtual time (the start tag of the request admitted
//! last), and a finish tag `start + tokens / weight`; waiters go in
//! finish-tag order, so one tenant's long prompts cannot starve another's
//! short ones, and a tenant that was idle does not bank credit.

/// Virtual-time units per token at weight 1.
const TAG_SCALE: u64 = 1 << 10;

/// Tenants remembered for fair share at most; idle ones (whose last finish
/// the virtual time has passed) are forgotten first.
const MAX_TENANTS: usize = 4096;

#[derive(Default)]
pub(super) struct Fair {
    /// Each tenant's last virtual finish tag here.
    tenants: crate::affinity::hrw::UniformMap<u64, u64>,
    /// The start tag of the request admitted here last.
    vtime: u64,
}

impl Fair {
    /// Where a request of `tenant` would start in virtual time here: no
    /// earlier than the tenant's last finish nor than the virtual time.
    pub(super) fn start_tag(&self, tenant: u64) -> u64 {
        self.tenants
            .get(&tenant)
            .copied()
            .unwrap_or(0)
            .max(self.vtime)
    }

    /// Where a request that starts at `start`, of `tokens` at `weight`
    /// (at least 1), finishes.
    pub(super) fn finish_tag(start: u64, tokens: u64, weight: u32) -> u64 {
        start + tokens.max(1) * TAG_SCALE / weight.max(1) as u64
    }

    /// A request that started at `start` was admitted: the virtual time
    /// moves to it.
    pub(super) fn admitted(&mut self, start: u64) {
        self.vtime = self.vtime.max(start);
    }

    /// `tenant`'s last request here finishes at `finish`.
    pub(super) fn remember(&mut self, tenant: u64, finish: u64) {
        if self.tenants.len() >= MAX_TENANTS && !self.tenants.contains_key(&tenant) {
            let vtime = self.vtime;
            self.tenants.retain(|_, last| *last > vtime);
            if self.tenants.len() >= MAX_TENANTS {
                return; // every one busy: this tenant starts from the virtual time
            }
        }
        self.tenants.insert(tenant, finish);
    }
}
