//! The route of a request decided without a network: a tier of three
//! backends that nothing connects to, the gateway's tables made fresh for
//! each test, requests read as the proxy reads them ([`Intake`]). Each test
//! is one rule.

use super::*;
use crate::admission::fleet::Asker;
use crate::admission::{Admission, Class, Slot};
use crate::affinity::prefix::Prefix;
use crate::affinity::responses::ResponseRoutes;
use crate::affinity::session::RequestHeaders;
use crate::affinity::Affinity;
use crate::affinity::Reason;
use crate::config::Config;
use crate::errors::{GatewayError, Refusal};
use crate::metrics::Metrics;
use crate::upstream::{Backend, Tier};
use crate::upstream::{Routing, Slots};
use pingora_load_balancing::HealthRegistry;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

const HASH_KEY: &str = "64e38e9e473f1eebd4b85cf92d09e5e090ea05ac1e1fdbfc59399632386d0813";

/// A gateway's tables and one configuration, with no proxy around them.
struct Fleet {
    routing: Arc<Routing>,
    affinity: Arc<Affinity>,
    prefix: Prefix,
    responses: ResponseRoutes,
    admission: Arc<Admission>,
    metrics: Metrics,
}

/// Three backends, `b0` to `b2`; `affinity` adds keys to that section,
/// `rest` whole sections.
fn fleet(affinity: &str, rest: &str) -> Fleet {
    let yaml = format!(
        "affinity: {{ hash_key: \"{HASH_KEY}\"{affinity} }}\n\
         tiers:\n  default:\n    default: true\n    backends:\n\
         \x20     - {{ id: b0, addr: \"127.0.0.1:1\" }}\n\
         \x20     - {{ id: b1, addr: \"127.0.0.1:2\" }}\n\
         \x20     - {{ id: b2, addr: \"127.0.0.1:3\" }}\n{rest}"
    );
    let config = Arc::new(Config::from_yaml(&yaml).expect("a valid test config"));
    let metrics = Metrics::new();
    let registry = Arc::new(HealthRegistry::new());
    let routing = Routing::build(Arc::clone(&config), &Slots::default(), &registry, &metrics)
        .expect("one tier");
    let a = &config.affinity;
    Fleet {
        affinity: Affinity::new(a.max_bindings, a.sticky_ttl),
        prefix: Prefix::new(
            &a.prefix,
            routing.hasher.prefix_seed(),
            Duration::from_secs(1800),
        ),
        responses: ResponseRoutes::new(a.max_bindings, 1_800_000),
        admission: Admission::new(config.admission.max_queued),
        metrics,
        routing: Arc::new(routing),
    }
}

/// What a test request carries: its path, headers and JSON body.
struct Ask<'a> {
    path: &'a str,
    headers: &'a [(&'a str, &'a str)],
    body: String,
}

fn chat(headers: &'static [(&'static str, &'static str)], turns: &[&str]) -> Ask<'static> {
    Ask {
        path: "/v1/chat/completions",
        headers,
        body: messages(turns),
    }
}

/// A chat body: a system prompt of its own, then `turns`, user and
/// assistant in turn, each long enough for the prefix index's blocks.
fn messages(turns: &[&str]) -> String {
    let mut m = vec![
        serde_json::json!({"role": "system", "content": "You are a careful agent. ".repeat(40)}),
    ];
    for (i, t) in turns.iter().enumerate() {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        m.push(serde_json::json!({"role": role, "content": t.repeat(60)}));
    }
    serde_json::json!({"model": "m", "messages": m}).to_string()
}

impl Fleet {
    fn tables(&self) -> Tables<'_> {
        Tables {
            affinity: &self.affinity,
            prefix: &self.prefix,
            responses: &self.responses,
            store: None,
            admission: &self.admission,
            metrics: &self.metrics,
        }
    }

    fn tier(&self) -> &Arc<Tier> {
        self.routing.default_tier()
    }

    fn backend(&self, id: &str) -> &Arc<Backend> {
        self.tier().backend_by_id(id).expect("a test backend")
    }

    /// `id` fails its health checks (or comes back).
    fn set_healthy(&self, id: &str, healthy: bool) {
        self.backend(id)
            .stats
            .admitted
            .store(healthy, Ordering::Relaxed);
    }

    /// The request as the proxy reads it (`proxy/request.rs`).
    async fn read(&self, ask: &Ask<'_>) -> Result<Route, GatewayError> {
        let mut map = http::HeaderMap::new();
        for (k, v) in ask.headers {
            map.insert(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                http::HeaderValue::from_str(v).unwrap(),
            );
        }
        let headers = RequestHeaders::new(&map);
        let uri: http::Uri = ask.path.parse().unwrap();
        let mut intake = Intake::read(Arc::clone(&self.routing), &headers, &uri, false)?;
        intake.scope(None, &headers)?;
        intake.tier(&headers)?;
        intake.read_path(self.tables()).await;
        let body = ask.body.as_bytes();
        let need = intake.body_need(self.tables(), !body.is_empty(), Some(body.len() as u64));
        if need != BodyNeed::None {
            intake.read_body(self.tables(), body).await?;
        }
        Ok(Route::new(intake.finish(body.len() as u64)))
    }

    /// Read and decided (admission off), and sent: the route, or the
    /// error answered.
    async fn route(&self, ask: &Ask<'_>) -> Result<Route, GatewayError> {
        let mut route = self.read(ask).await?;
        route
            .decide(self.tables(), None, || false)
            .await
            .map_err(answer)?;
        route.confirm();
        Ok(route)
    }

    /// Routed and answered 200: where it went.
    async fn turn(&self, ask: &Ask<'_>) -> (String, Reason) {
        let route = self.route(ask).await.expect("routed");
        let d = route.decision().expect("decided");
        let out = (d.backend.id.to_string(), d.reason);
        let tokens = route.request().prompt_tokens();
        route.end(self.tables(), 200, Some((tokens, Some(0))), true);
        out
    }
}

fn answer(r: Refusal) -> GatewayError {
    match r {
        Refusal::Answer(e) => e,
        Refusal::ClientGone(why) => panic!("{why}"),
    }
}

/// The code of the error a request was answered, if it was.
fn code<T>(r: Result<T, GatewayError>) -> Option<&'static str> {
    r.err().map(|e| e.code)
}

const S1: &[(&str, &str)] = &[("x-session-id", "s1")];
const NONE: &[(&str, &str)] = &[];

#[tokio::test]
async fn a_keyed_sessions_turns_stay_on_the_backend_its_first_went_to() {
    let f = fleet("", "");
    let (first, why) = f.turn(&chat(S1, &["fix the parser"])).await;
    assert_eq!(why, Reason::FirstTurn);
    for n in 1..6 {
        let turns = ["fix the parser", "done", "now the tests"];
        let (next, why) = f.turn(&chat(S1, &turns[..=(n % 3)])).await;
        assert_eq!((next.as_str(), why), (first.as_str(), Reason::Hit));
    }
}

#[tokio::test]
async fn new_sessions_spread_over_the_tier_by_their_keys() {
    let f = fleet("", "");
    let mut seen = std::collections::HashSet::new();
    for s in 0..24 {
        let h = [("x-session-id", format!("spread-{s}"))];
        let headers: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let ask = Ask {
            path: "/v1/chat/completions",
            headers: &headers,
            body: messages(&[&format!("task {s}")]),
        };
        seen.insert(f.turn(&ask).await.0);
    }
    assert_eq!(seen.len(), 3, "24 sessions on {seen:?}");
}

#[tokio::test]
async fn a_binding_to_a_backend_that_went_down_rebinds_and_says_broken() {
    let f = fleet("", "");
    let (first, _) = f.turn(&chat(S1, &["fix the parser"])).await;
    f.set_healthy(&first, false);
    let (next, why) = f.turn(&chat(S1, &["fix the parser", "ok", "go on"])).await;
    assert_ne!(next, first);
    assert_eq!(why, Reason::Broken);
    assert_eq!(f.tier().metrics.broken.get(), 1);
    // It stays where it was rebound, though the first is back.
    f.set_healthy(&first, true);
    let (again, why) = f
        .turn(&chat(S1, &["fix the parser", "ok", "go on", "x", "y"]))
        .await;
    assert_eq!((again.as_str(), why), (next.as_str(), Reason::Hit));
}

#[tokio::test]
async fn a_keyless_request_without_a_prompt_goes_to_the_least_busy_backend() {
    let f = fleet("", "");
    f.backend("b0").stats.in_flight.store(5, Ordering::Relaxed);
    f.backend("b2").stats.in_flight.store(3, Ordering::Relaxed);
    let ask = Ask {
        path: "/v1/models",
        headers: NONE,
        body: String::new(),
    };
    for _ in 0..4 {
        let route = f.route(&ask).await.unwrap();
        let d = route.decision().unwrap();
        assert_eq!((&*d.backend.id, d.reason), ("b1", Reason::NoSession));
    }
}

#[tokio::test]
async fn a_keyless_conversation_is_named_by_its_prompt_and_its_turns_follow_it() {
    let f = fleet("", "");
    let first = f.route(&chat(NONE, &["plan the refactor"])).await.unwrap();
    let key = first.request().key.as_ref().map(|k| k.key);
    assert!(key.is_some(), "a prompt names its conversation");
    let name = first.request().session().map(|s| s.id.clone()).unwrap();
    assert!(name.starts_with("prompt-"), "{name}");
    let went = first.decision().unwrap().backend.id.to_string();
    first.end(
        f.tables(),
        200,
        Some((first.request().prompt_tokens(), Some(0))),
        true,
    );
    for turns in [
        &["plan the refactor", "here is the plan", "do step one"][..],
        &[
            "plan the refactor",
            "here is the plan",
            "do step one",
            "done",
            "step two",
        ][..],
    ] {
        let next = f.route(&chat(NONE, turns)).await.unwrap();
        assert_eq!(next.request().key.as_ref().map(|k| k.key), key);
        let d = next.decision().unwrap();
        assert_eq!(
            (d.backend.id.to_string(), d.reason),
            (went.clone(), Reason::Hit)
        );
        next.end(
            f.tables(),
            200,
            Some((next.request().prompt_tokens(), Some(0))),
            true,
        );
    }
}

#[tokio::test]
async fn a_fork_of_a_conversation_is_its_own_and_starts_where_the_transcript_is() {
    // One fork per fleet: a second one there may find the parent's backend
    // over the balance bound (its own rule, tested in `bounded_hrw`).
    for task in ["write the tests", "review the fix", "update the docs"] {
        let f = fleet("", "");
        let (went, _) = f.turn(&chat(NONE, &["read the parser's grammar"])).await;
        let transcript = ["read the parser's grammar", "read it"];
        let parent = f
            .route(&chat(NONE, &[transcript[0], transcript[1], "fix the bug"]))
            .await;
        let parent = parent.unwrap();
        let parent_key = parent.request().key.as_ref().unwrap().key;
        parent.end(
            f.tables(),
            200,
            Some((parent.request().prompt_tokens(), Some(0))),
            true,
        );
        let child = f
            .route(&chat(NONE, &[transcript[0], transcript[1], task]))
            .await;
        let child = child.unwrap();
        let key = child.request().key.as_ref().unwrap();
        assert_ne!(key.key, parent_key, "{task}: a conversation of its own");
        assert_eq!(key.forked_at, Some(f.backend(&went).slot), "{task}");
        assert_eq!(&*child.decision().unwrap().backend.id, went, "{task}");
    }
}

#[tokio::test]
async fn a_subagent_goes_where_its_parent_session_is() {
    let f = fleet("", "");
    let (parent, _) = f.turn(&chat(S1, &["lead the task"])).await;
    for child in 0..6 {
        let id = format!("sub-{child}");
        let headers = [("x-parent-session-id", "s1"), ("x-session-id", id.as_str())];
        let ask = Ask {
            path: "/v1/chat/completions",
            headers: &headers,
            body: messages(&[&format!("subtask {child}")]),
        };
        assert_eq!(f.turn(&ask).await.0, parent, "subagent {child}");
    }
}

#[tokio::test]
async fn a_last_turn_closes_its_binding() {
    let f = fleet("", "");
    let route = f.route(&chat(S1, &["one question"])).await.unwrap();
    let key = route.request().key.as_ref().unwrap().key;
    route.end(f.tables(), 200, Some((10, Some(0))), true);
    assert!(f.affinity.is_live(key));
    let last: &[(&str, &str)] = &[("x-session-id", "s1"), ("x-dynamo-session-final", "true")];
    let (_, why) = f
        .turn(&chat(last, &["one question", "answer", "thanks"]))
        .await;
    assert_eq!(why, Reason::Hit);
    assert!(!f.affinity.is_live(key), "closed by its last turn");
}

#[tokio::test]
async fn bad_input_leaves_no_new_binding_but_keeps_an_old_one() {
    let f = fleet("", "");
    let route = f.route(&chat(S1, &["first"])).await.unwrap();
    let key = route.request().key.as_ref().unwrap().key;
    route.forget_new_binding(f.tables());
    assert!(!f.affinity.is_live(key), "the binding it made is gone");
    f.turn(&chat(S1, &["first"])).await;
    let again = f.route(&chat(S1, &["first", "a", "second"])).await.unwrap();
    again.forget_new_binding(f.tables());
    assert!(f.affinity.is_live(key), "a binding made before stays");
}

#[tokio::test]
async fn no_healthy_backend_and_all_failed_are_told_apart() {
    let f = fleet("", "");
    let mut route = f.read(&chat(S1, &["x"])).await.unwrap();
    for b in ["b0", "b1", "b2"] {
        route.exclude(f.backend(b).slot);
    }
    let refused = route
        .decide(f.tables(), None, || false)
        .await
        .map_err(answer);
    assert_eq!(code(refused), Some("all_backends_failed"));
    for b in ["b0", "b1", "b2"] {
        f.set_healthy(b, false);
    }
    assert_eq!(
        code(f.route(&chat(S1, &["x"])).await),
        Some("no_healthy_backend")
    );
}

#[tokio::test]
async fn an_explicit_target_is_obeyed_when_allowed_and_healthy() {
    let off = fleet("", "");
    let to = |id: &'static str| -> Ask<'static> {
        let headers: &'static [(&str, &str)] = match id {
            "b2" => &[("x-agent-serve-backend-id", "b2"), ("x-session-id", "s1")],
            _ => &[("x-agent-serve-backend-id", "nope")],
        };
        chat(headers, &["x"])
    };
    assert_eq!(
        code(off.route(&to("b2")).await),
        Some("explicit_target_forbidden")
    );
    let f = fleet(", allow_explicit_target: true", "");
    for _ in 0..3 {
        let route = f.route(&to("b2")).await.unwrap();
        let d = route.decision().unwrap();
        assert_eq!((&*d.backend.id, d.reason), ("b2", Reason::ExplicitTarget));
    }
    assert_eq!(code(f.route(&to("nope")).await), Some("unknown_backend"));
    f.set_healthy("b2", false);
    assert_eq!(code(f.route(&to("b2")).await), Some("backend_unavailable"));
}

/// A Responses request in session `s`, following `previous` when given.
fn responses(
    headers: &'static [(&'static str, &'static str)],
    previous: Option<&str>,
) -> Ask<'static> {
    let mut body = serde_json::json!({"model": "m", "input": "go on ".repeat(50)});
    if let Some(id) = previous {
        body["previous_response_id"] = id.into();
    }
    Ask {
        path: "/v1/responses",
        headers,
        body: body.to_string(),
    }
}

/// A Responses request answered with the engine's response `engine`: the
/// id the client is given, and where it went.
async fn stored_response(
    f: &Fleet,
    headers: &'static [(&'static str, &'static str)],
    engine: &str,
) -> (String, String) {
    let route = f.route(&responses(headers, None)).await.unwrap();
    route.learn_response(f.tables(), engine);
    let issued = route
        .issue_response_id(engine)
        .expect("issued by the gateway");
    (issued, route.decision().unwrap().backend.id.to_string())
}

#[tokio::test]
async fn a_follow_up_of_a_stored_response_goes_to_the_backend_that_stored_it() {
    let f = fleet("", "");
    const SESSIONS: [&[(&str, &str)]; 6] = [
        &[("x-session-id", "r0")],
        &[("x-session-id", "r1")],
        &[("x-session-id", "r2")],
        &[("x-session-id", "r3")],
        &[("x-session-id", "r4")],
        &[("x-session-id", "r5")],
    ];
    for (n, s) in SESSIONS.into_iter().enumerate() {
        let (issued, holder) = stored_response(&f, s, &format!("resp_engine_{n}")).await;
        // The follow-up carries no session of its own: the id leads.
        let route = f.route(&responses(NONE, Some(&issued))).await.unwrap();
        assert_eq!(&*route.decision().unwrap().backend.id, holder);
        assert_eq!(
            route.followed_ids(),
            Some((&*format!("resp_engine_{n}"), &*issued))
        );
    }
}

#[tokio::test]
async fn a_stored_responses_follow_up_is_refused_when_its_holder_is_down() {
    let f = fleet("", "");
    let (issued, holder) = stored_response(&f, S1, "resp_engine").await;
    f.set_healthy(&holder, false);
    let refused = f
        .route(&responses(NONE, Some(&issued)))
        .await
        .err()
        .unwrap();
    assert_eq!(refused.code, "previous_response_not_found");
    assert!(
        refused
            .message
            .contains(&format!("`{holder}`, which stored it, is not healthy")),
        "{}",
        refused.message
    );
}

#[tokio::test]
async fn another_tenants_response_id_is_no_response_here() {
    let f = fleet(", tenant_header: x-tenant", "");
    const A: &[(&str, &str)] = &[("x-tenant", "a"), ("x-session-id", "s1")];
    const B: &[(&str, &str)] = &[("x-tenant", "b")];
    let (issued, _) = stored_response(&f, A, "resp_engine").await;
    // The issued id, and the engine's own read off it: neither reaches
    // the replica for tenant b.
    // It is told there is no such response, as an engine says it; not
    // where one is kept.
    for id in [issued.as_str(), "resp_engine"] {
        let refused = f.route(&responses(B, Some(id))).await.err().unwrap();
        assert_eq!(refused.code, "previous_response_not_found");
        assert_eq!(
            refused.message,
            format!("Response with id '{id}' not found.")
        );
    }
}

/// Admission's side of a placement, scripted: the slots it answers in turn,
/// and what each seat was asked.
struct Scripted {
    answers: Vec<Slot>,
    /// The backend each seat was asked at, with how many idle others it
    /// was told of.
    asked: Vec<(String, usize)>,
}

impl Seats for Scripted {
    fn who(&self) -> (Class, u64) {
        (Class::Normal, 0)
    }
    fn asker(&self) -> Asker {
        Asker {
            tenant: 0,
            weight: 1,
            class: Class::Normal,
        }
    }
    fn claimed(&mut self, _: Option<u64>) {}
    fn client_gone(&self) -> bool {
        false
    }
    async fn seat(&mut self, route: &mut Route, idle: Vec<Arc<str>>) -> Result<Slot, Refusal> {
        let id = route.backend().expect("decided").id.to_string();
        self.asked.push((id, idle.len()));
        Ok(self.answers.remove(0))
    }
}

const ADMISSION: &str = "admission: { enabled: true }\n";

#[tokio::test]
async fn a_backend_that_went_while_the_request_waited_is_left_out_and_the_session_rebound() {
    let f = fleet("", ADMISSION);
    let mut route = f.read(&chat(S1, &["x"])).await.unwrap();
    let mut seats = Scripted {
        answers: vec![Slot::BackendGone, Slot::Held],
        asked: Vec::new(),
    };
    route.place(f.tables(), &mut seats).await.unwrap();
    let [(first, _), (second, _)] = &seats.asked[..] else {
        panic!("{:?}", seats.asked)
    };
    assert_ne!(first, second);
    assert_eq!(&*route.backend().unwrap().id, second);
    let key = route.request().key.as_ref().unwrap().key;
    let bound = f.affinity.binding(key).expect("bound").backend;
    assert_eq!(bound, f.backend(second).slot, "the session follows it");
}

#[tokio::test]
async fn a_raced_placement_is_placed_once_more_elsewhere() {
    let f = fleet("", ADMISSION);
    let mut route = f.read(&chat(S1, &["x"])).await.unwrap();
    let mut seats = Scripted {
        answers: vec![Slot::Raced, Slot::Held],
        asked: Vec::new(),
    };
    route.place(f.tables(), &mut seats).await.unwrap();
    assert_eq!(seats.asked.len(), 2);
    assert_ne!(seats.asked[0].0, seats.asked[1].0, "not where it was raced");
    assert_eq!(seats.asked[1].1, 0, "its second seat claims nothing idle");
}

#[tokio::test]
async fn without_admission_a_request_is_placed_without_a_seat() {
    let f = fleet("", "");
    let mut route = f.read(&chat(S1, &["x"])).await.unwrap();
    let mut seats = Scripted {
        answers: Vec::new(),
        asked: Vec::new(),
    };
    route.place(f.tables(), &mut seats).await.unwrap();
    assert!(seats.asked.is_empty());
    assert!(route.backend().is_some());
}

#[tokio::test]
async fn a_lost_answer_is_sent_elsewhere_only_when_its_backend_is_gone() {
    let f = fleet("", "");
    let ask = chat(S1, &["x"]);
    let mut route = f.route(&ask).await.unwrap();
    let first = route.backend().unwrap().slot;
    assert_eq!(route.resend(first, true, false, false), Resend::Elsewhere);
    route.decide(f.tables(), None, || false).await.unwrap();
    let elsewhere = route.backend().unwrap();
    assert_ne!(elsewhere.slot, first);
    assert_eq!(route.decision().unwrap().reason, Reason::Broken);
    // On a connection the backend closed as it was reused: the same one.
    let mut route = f
        .route(&chat(&[("x-session-id", "s2")], &["y"]))
        .await
        .unwrap();
    let at = route.backend().unwrap().slot;
    assert_eq!(route.resend(at, false, false, true), Resend::Same);
    route.replayed = true;
    route.decide(f.tables(), None, || false).await.unwrap();
    assert_eq!(route.backend().unwrap().slot, at);
    // A fresh connection closed by a live backend: it may be running it.
    assert_eq!(route.resend(at, false, false, false), Resend::Not);
    assert_eq!(route.resend(at, false, true, false), Resend::Anywhere);
}

#[tokio::test]
async fn a_replay_reports_its_first_attempts_hit_and_reason() {
    let f = fleet("", "");
    let mut route = f.route(&chat(S1, &["x"])).await.unwrap();
    assert_eq!(route.decision().unwrap().reason, Reason::FirstTurn);
    route.replayed = true;
    route.confirm();
    route.decide(f.tables(), None, || false).await.unwrap();
    let d = route.decision().unwrap();
    assert_eq!((d.reason, d.affinity_hit), (Reason::FirstTurn, false));
}
