use proptest::prelude::*;

use super::*;

fn nixl(label: &str, on_done: bool) -> (bool, bool, bool, bool, String) {
    (false, false, true, on_done, label.to_owned())
}

#[allow(clippy::unnecessary_wraps)] // an outcome as Python reports it
fn ok(s: &str) -> Outcome {
    Ok(s.to_owned())
}

#[test]
fn a_read_that_lands_at_once_is_released_and_finished() {
    let mut f = PullParts::new(vec![nixl("a", false)], None);
    let q = f.begin();
    assert_eq!(q.xfer, vec![0]);
    assert!(f.observe(&[], &[], &[ok("PROC")]).is_empty());
    assert!(f.after_on_done(&[], &[]).is_empty());
    assert_eq!(f.settle(&[], false), (Releases::default(), false));
    f.begin();
    f.observe(&[], &[], &[ok("DONE")]);
    assert_eq!(f.after_on_done(&[], &[]), vec![0]);
    let (r, terminal) = f.settle(&[true], false);
    assert_eq!(r, Releases { abort: vec![0], drop: vec![0], finish: vec![0] });
    assert!(terminal && f.error().is_none());
}

#[test]
fn a_queued_landing_waits_with_its_handle_released_and_its_cleanup_kept() {
    let mut f = PullParts::new(vec![nixl("a", true)], None);
    f.begin();
    assert_eq!(f.observe(&[], &[], &[ok("DONE")]), vec![0]);
    assert_eq!(f.after_on_done(&[0], &[ok("")]), vec![0]);
    let (r, terminal) = f.settle(&[false], false);
    assert_eq!(r, Releases { abort: vec![0], drop: vec![0], finish: vec![] });
    assert!(!terminal);
    assert_eq!(f.state(0), Some(PartState::Land));
    assert_eq!(f.begin().landed, vec![0]);
    f.observe(&[true], &[], &[]);
    f.after_on_done(&[], &[]);
    let (r, terminal) = f.settle(&[], false);
    assert_eq!(r, Releases { abort: vec![], drop: vec![0], finish: vec![0] });
    assert!(terminal);
}

#[test]
fn the_first_failure_is_kept_and_the_pull_waits_for_every_part() {
    let parts = vec![nixl("a", true), nixl("b", false), (true, false, false, false, "c".into())];
    let mut f = PullParts::new(parts, None);
    let q = f.begin();
    assert_eq!((q.xfer.clone(), q.step.clone()), (vec![0, 1], vec![2]));
    let on_done = f.observe(&[], &[ok("PROC")], &[ok("DONE"), ok("PROC")]);
    f.after_on_done(&on_done, &[Err("RuntimeError('boom')".into())]);
    let (r, terminal) = f.settle(&[], false);
    assert_eq!((r.finish, terminal), (vec![0], false));
    assert_eq!(f.error(), Some("scatter of a failed: RuntimeError('boom')"));
    f.begin();
    f.observe(&[], &[Err("x".into())], &[Err("gone".into())]);
    f.after_on_done(&[], &[]);
    assert!(f.settle(&[], false).1);
    assert_eq!(f.error(), Some("scatter of a failed: RuntimeError('boom')"));
}

#[test]
fn cancel_fails_the_running_parts_and_aborts_their_reads() {
    let mut f =
        PullParts::new(vec![nixl("a", false), (false, true, false, false, "ipc".into())], None);
    let r = f.cancel();
    assert_eq!(r, Releases { abort: vec![0], drop: vec![0, 1], finish: vec![0, 1] });
    assert!(f.terminal());
    assert_eq!(f.error(), Some("cancelled a at the quarantine drain horizon"));
}

#[test]
fn past_the_deadline_a_part_with_nothing_in_flight_fails_quietly_and_the_others_run_on() {
    let step = |l: &str| (true, false, false, false, l.to_owned());
    let mut f = PullParts::new(vec![step("waiting"), step("reading"), nixl("direct", false)], None);
    // Before the deadline a waiting part just waits.
    f.begin();
    f.observe(&[], &[ok("WAIT"), ok("PROC")], &[ok("PROC")]);
    f.after_on_done(&[], &[]);
    assert_eq!(f.settle(&[], false), (Releases::default(), false));
    assert!(f.quiet(0) && !f.quiet(1) && !f.quiet(2));
    // Past it, the waiting part fails at once (its cleanup runs); a part with a read in
    // flight and a NIXL read keep the pull running (they may still write).
    f.begin();
    f.observe(&[], &[ok("WAIT"), ok("PROC")], &[ok("PROC")]);
    f.after_on_done(&[], &[]);
    let (r, terminal) = f.settle(&[], true);
    assert_eq!((r, terminal), (Releases { abort: vec![], drop: vec![0], finish: vec![0] }, false));
    assert_eq!(f.state(0), Some(PartState::Err));
    assert!(f.error().unwrap().contains("waiting read nothing by the deadline"), "{:?}", f.error());
    // A part that waited and then posted a read is no longer quiet.
    let mut g = PullParts::new(vec![step("s")], None);
    for answer in ["WAIT", "PROC"] {
        g.begin();
        g.observe(&[], &[ok(answer)], &[]);
        g.after_on_done(&[], &[]);
    }
    assert_eq!(g.settle(&[], true), (Releases::default(), false));
    // Every part quiet: the pull is terminal, failed, with nothing that may still write.
    g.begin();
    g.observe(&[], &[ok("WAIT")], &[]);
    g.after_on_done(&[], &[]);
    assert!(g.settle(&[], true).1 && g.error().is_some());
}

proptest! {
    /// Oracle: whatever the answers, a part's cleanup runs at most once, only once it is
    /// terminal, and the pull is terminal exactly when every part is done or failed; a handle
    /// is returned to the agent at most once.
    #[test]
    fn every_part_is_finished_once_and_only_when_terminal(
        kinds in proptest::collection::vec((any::<bool>(), any::<bool>(), any::<bool>()), 1..5),
        answers in proptest::collection::vec(0u8..4, 0..200),
    ) {
        let parts = kinds.iter().enumerate()
            .map(|(i, &(step, local, on_done))| (step, local, !local, on_done, format!("p{i}")))
            .collect();
        let mut f = PullParts::new(parts, None);
        let n = kinds.len();
        let (mut finished, mut aborted) = (vec![0; n], vec![0; n]);
        // The last answer of each part's step (only a part that steps answers "WAIT").
        let mut last: Vec<Outcome> = vec![ok("PROC"); n];
        let mut it = answers.into_iter().cycle();
        let mut pick = move || it.next().unwrap_or(0);
        for _ in 0..50 {
            let q = f.begin();
            let landed: Vec<bool> = q.landed.iter().map(|_| pick() % 2 == 0).collect();
            let step: Vec<Outcome> = q.step.iter()
                .map(|_| match pick() {
                    0 => Err("e".into()), 1 => ok("DONE"), 2 => ok("WAIT"), _ => ok("PROC")
                })
                .collect();
            for (&i, answer) in q.step.iter().zip(&step) {
                last[i] = answer.clone();
            }
            let xfer: Vec<Outcome> = q.xfer.iter()
                .map(|_| match pick() { 0 => ok("ERR"), 1 => ok("DONE"), _ => ok("PROC") })
                .collect();
            let on_done = f.observe(&landed, &step, &xfer);
            let outcomes: Vec<Outcome> =
                on_done.iter().map(|_| if pick() == 0 { Err("s".into()) } else { ok("") }).collect();
            let settle = f.after_on_done(&on_done, &outcomes);
            let land: Vec<bool> = settle.iter().map(|_| pick() % 2 == 0).collect();
            let expired = pick() == 3;
            let was_running: Vec<bool> =
                (0..n).map(|i| f.state(i) == Some(PartState::Proc)).collect();
            let quiet: Vec<bool> = (0..n).map(|i| f.quiet(i)).collect();
            for i in 0..n {
                prop_assert_eq!(quiet[i], was_running[i] && last[i] == ok("WAIT"));
            }
            let (r, terminal) = f.settle(&land, expired);
            // The deadline fails exactly the running parts whose last step was "WAIT" (a step
            // part that answered "WAIT" this poll, or kept quiet from an earlier one).
            for i in 0..n {
                if was_running[i] && expired {
                    prop_assert_eq!(f.state(i) == Some(PartState::Err), quiet[i]);
                }
            }
            for i in r.finish {
                finished[i] += 1;
                prop_assert!(matches!(f.state(i), Some(PartState::Done | PartState::Err)));
            }
            for i in r.abort { aborted[i] += 1; }
            prop_assert_eq!(terminal, (0..n).all(|i| matches!(f.state(i), Some(PartState::Done | PartState::Err))));
            if terminal { break; }
        }
        prop_assert!(finished.iter().all(|&c| c <= 1));
        prop_assert!(aborted.iter().all(|&c| c <= 1));
        for (i, &count) in finished.iter().enumerate() {
            let terminal = matches!(f.state(i), Some(PartState::Done | PartState::Err));
            prop_assert_eq!(count == 1, terminal);
        }
    }
}
