//! Progress of one pull made of parts that settle on their own, as a sans-IO fold.
//!
//! A part is a NIXL read (polled through the agent, optionally followed by an `on_done` step
//! that queues its landing), a chunked read that drives itself (`step`), or a local GPU copy
//! settled by its landing alone. Each poll asks the caller for what it must observe
//! ([`PullParts::begin`]), folds the answers ([`PullParts::observe`],
//! [`PullParts::after_on_done`]) and says what to release ([`PullParts::settle`]). A failed
//! part keeps the first error; the pull is terminal once no part is running or landing, so a
//! failed pull never leaves a part that may still write.
//!
//! A part that drives itself may report that it has nothing in flight (`"WAIT"`: no read
//! posted, no landing queued; a staged read waiting for its source's announcement): past the
//! pull's deadline such a part fails at once, quietly (it cannot write anything), rather than
//! keep the pull running as one that may still write.

/// What a part is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartKind {
    /// A posted NIXL read, polled through the agent.
    Nixl,
    /// A read that drives its own transfers (chunked staging).
    Step,
    /// A local GPU copy, settled by its landing.
    Local,
}

/// Where a part stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartState {
    /// Running.
    Proc,
    /// Its transfer finished; its landing (scatter) is still queued.
    Land,
    /// Finished.
    Done,
    /// Failed.
    Err,
}

#[derive(Debug, Clone)]
struct Part {
    kind: PartKind,
    state: PartState,
    has_xfer: bool,
    has_on_done: bool,
    /// Its last step reported nothing in flight (`"WAIT"`).
    quiet: bool,
    context: String,
}

/// One call's outcome: the value returned, or the exception's repr.
pub type Outcome = Result<String, String>;

/// What to release after a poll: transfer handles to abort (`abort`), handles to drop
/// (`drop`, a superset), parts whose cleanup runs (`finish`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Releases {
    /// Parts whose transfer handle goes back to the agent.
    pub abort: Vec<usize>,
    /// Parts whose transfer handle is forgotten.
    pub drop: Vec<usize>,
    /// Parts whose cleanup runs.
    pub finish: Vec<usize>,
}

/// The questions of one poll: parts whose landing to test, whose `step` to run and whose
/// transfer state to read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Queries {
    /// Parts whose landing to test (true: landed or nothing to land).
    pub landed: Vec<usize>,
    /// Parts whose `step()` to run.
    pub step: Vec<usize>,
    /// Parts whose NIXL transfer state to read.
    pub xfer: Vec<usize>,
}

/// The parts of one pull and the first error.
#[derive(Debug, Clone)]
pub struct PullParts {
    parts: Vec<Part>,
    error: Option<String>,
    asked: Queries,
    settling: Vec<usize>,
    finished: Vec<usize>,
    releases: Releases,
}

impl PullParts {
    /// Parts `(drives itself, local copy, has a transfer handle, has an on_done step, label)`,
    /// all running (a part that drives itself is a [`PartKind::Step`] whatever else it is);
    /// `error`: a failure before the parts were posted.
    pub fn new(parts: Vec<(bool, bool, bool, bool, String)>, error: Option<String>) -> Self {
        let parts = parts
            .into_iter()
            .map(|(step, local, has_xfer, has_on_done, context)| Part {
                kind: match (step, local) {
                    (true, _) => PartKind::Step,
                    (false, true) => PartKind::Local,
                    (false, false) => PartKind::Nixl,
                },
                state: PartState::Proc,
                has_xfer,
                has_on_done,
                quiet: false,
                context,
            })
            .collect();
        Self {
            parts,
            error,
            asked: Queries::default(),
            settling: Vec::new(),
            finished: Vec::new(),
            releases: Releases::default(),
        }
    }

    /// The first failure, if any.
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }

    /// State of part `i`.
    pub fn state(&self, i: usize) -> Option<PartState> {
        self.parts.get(i).map(|p| p.state)
    }

    /// Whether no part is running or landing.
    pub fn terminal(&self) -> bool {
        self.parts.iter().all(|p| matches!(p.state, PartState::Done | PartState::Err))
    }

    fn fail(&mut self, i: usize, message: String) {
        self.parts[i].state = PartState::Err;
        self.error.get_or_insert(message);
    }

    /// Release part `i`: its handle, and its cleanup unless it is still landing.
    fn release(&mut self, i: usize) {
        let p = &mut self.parts[i];
        if p.has_xfer && p.kind != PartKind::Local {
            self.releases.abort.push(i);
        }
        p.has_xfer = false;
        self.releases.drop.push(i);
        if p.state != PartState::Land {
            self.releases.finish.push(i);
        }
    }

    /// Start a poll: what the caller must observe of each part still running or landing.
    pub fn begin(&mut self) -> Queries {
        let mut q = Queries::default();
        for (i, p) in self.parts.iter().enumerate() {
            match (p.state, p.kind) {
                (PartState::Land, _) | (PartState::Proc, PartKind::Local) => q.landed.push(i),
                (PartState::Proc, PartKind::Step) => q.step.push(i),
                (PartState::Proc, PartKind::Nixl) => q.xfer.push(i),
                _ => {}
            }
        }
        self.asked = q.clone();
        self.settling.clear();
        self.finished.clear();
        self.releases = Releases::default();
        q
    }

    /// Fold the answers to [`Self::begin`]'s queries (in its order; a missing answer counts
    /// as not landed / still running); return the parts whose `on_done` to run now.
    pub fn observe(&mut self, landed: &[bool], steps: &[Outcome], xfers: &[Outcome]) -> Vec<usize> {
        let asked = std::mem::take(&mut self.asked);
        for (k, &i) in asked.landed.iter().enumerate() {
            if landed.get(k).copied().unwrap_or(false) {
                self.parts[i].state = PartState::Done;
                self.release(i);
            }
        }
        for (k, &i) in asked.step.iter().enumerate() {
            self.parts[i].quiet = false;
            match steps.get(k) {
                Some(Ok(s)) if s == "PROC" => continue,
                Some(Ok(s)) if s == "WAIT" => {
                    self.parts[i].quiet = true;
                    continue;
                }
                None => continue,
                Some(Ok(_)) => self.parts[i].state = PartState::Done,
                Some(Err(exc)) => {
                    let msg = format!("chunked read of {} failed: {exc}", self.parts[i].context);
                    self.fail(i, msg);
                }
            }
            self.release(i);
        }
        let mut on_done = Vec::new();
        for (k, &i) in asked.xfer.iter().enumerate() {
            let state = match xfers.get(k) {
                Some(Ok(s)) => s.as_str(),
                Some(Err(_)) => "ERR",
                None => "PROC",
            };
            match state {
                "DONE" => {
                    self.parts[i].state = PartState::Done;
                    if self.parts[i].has_on_done {
                        on_done.push(i);
                    }
                    self.finished.push(i);
                }
                "ERR" => {
                    let msg = format!("NIXL reported ERR for {}", self.parts[i].context);
                    self.fail(i, msg);
                    self.release(i);
                }
                // "PROC" (NIXL 1.x) or any other pending state.
                _ => {}
            }
        }
        on_done
    }

    /// Fold the outcomes of the `on_done` steps [`Self::observe`] asked for; return the
    /// finished reads whose landing to test.
    pub fn after_on_done(&mut self, asked: &[usize], outcomes: &[Outcome]) -> Vec<usize> {
        for (k, &i) in asked.iter().enumerate() {
            if let Some(Err(exc)) = outcomes.get(k) {
                let msg = format!("scatter of {} failed: {exc}", self.parts[i].context);
                self.fail(i, msg);
            }
        }
        let finished = std::mem::take(&mut self.finished);
        self.settling =
            finished.iter().copied().filter(|&i| self.parts[i].state == PartState::Done).collect();
        let failed: Vec<usize> =
            finished.iter().copied().filter(|&i| self.parts[i].state != PartState::Done).collect();
        for i in failed {
            self.release(i);
        }
        self.settling.clone()
    }

    /// Fold the landing answers for [`Self::after_on_done`]'s parts (a read whose landing is
    /// still queued waits in `Land`, its handle released); `expired`: the pull's deadline has
    /// passed, so every running part whose last step had nothing in flight fails (quietly:
    /// it posted nothing that may still write). Return what to release and whether every part
    /// is terminal.
    pub fn settle(&mut self, landed: &[bool], expired: bool) -> (Releases, bool) {
        let settling = std::mem::take(&mut self.settling);
        for (k, &i) in settling.iter().enumerate() {
            if !landed.get(k).copied().unwrap_or(true) {
                self.parts[i].state = PartState::Land;
            }
            self.release(i);
        }
        for i in 0..self.parts.len() {
            if expired && self.quiet(i) {
                let msg = format!(
                    "{} read nothing by the deadline (its source never announced the copy)",
                    self.parts[i].context
                );
                self.fail(i, msg);
                self.release(i);
            }
        }
        (std::mem::take(&mut self.releases), self.terminal())
    }

    /// Whether part `i` is running with nothing in flight (its last step said `"WAIT"`).
    pub fn quiet(&self, i: usize) -> bool {
        self.parts.get(i).is_some_and(|p| p.state == PartState::Proc && p.quiet)
    }

    /// Stop every running part (their reads are aborted); the pull counts as failed.
    pub fn cancel(&mut self) -> Releases {
        self.releases = Releases::default();
        for i in 0..self.parts.len() {
            if self.parts[i].state == PartState::Proc {
                let msg =
                    format!("cancelled {} at the quarantine drain horizon", self.parts[i].context);
                self.fail(i, msg);
                self.release(i);
            }
        }
        std::mem::take(&mut self.releases)
    }
}

#[cfg(test)]
#[path = "pull_parts_tests.rs"]
mod tests;
