//! The layering of `src`: no import cycle among the crate's top-level
//! modules. Lower layers (clock, metrics, affinity, config, upstream, the
//! gateway's state) must not know the ones above them (the fleet, the proxy,
//! services, the server); a cycle means a concept has no single owner.
//! Inside the session router (`src/affinity/`) the arrows are one-way too:
//! a module never imports from the module that contains it (the parent is
//! the face and the router; its children are its parts), and the binding
//! table is reached from outside only through the router.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The crate's top-level modules, from `lib.rs`.
fn modules(src: &Path) -> BTreeSet<String> {
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    lib.lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod "))
        .map(|m| m.trim_end_matches(';').to_string())
        .collect()
}

/// A file's code without its tests and comments.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or("");
    text.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The crate's top-level modules each file's code names (`crate::x`).
fn references(code: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = group.split('}').next().unwrap_or("");
            for name in group.split(',') {
                let name = name.trim().split("::").next().unwrap_or("").trim();
                if modules.contains(name) {
                    out.insert(name.to_string());
                }
            }
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if modules.contains(&name) {
            out.insert(name);
        }
    }
    out
}

fn walk(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            walk(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

/// Top-level module → (module it names → the files that do).
fn graph(src: &Path) -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let modules = modules(src);
    let mut files = Vec::new();
    walk(src, &mut files);
    let mut g: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(src).unwrap().to_string_lossy().to_string();
        let top = rel
            .split('/')
            .next()
            .unwrap()
            .trim_end_matches(".rs")
            .to_string();
        if !modules.contains(&top) {
            continue; // lib.rs, main.rs
        }
        let text = std::fs::read_to_string(&f).unwrap();
        for m in references(&code(&text), &modules) {
            if m != top {
                g.entry(top.clone())
                    .or_default()
                    .entry(m)
                    .or_default()
                    .insert(rel.clone());
            }
        }
    }
    g
}

/// A cycle through the graph, as its modules in order, if there is one.
fn cycle(g: &BTreeMap<String, BTreeMap<String, BTreeSet<String>>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        g: &BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut c = path[at..].to_vec();
            c.push(m.to_string());
            return Some(c);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for next in g.get(m).into_iter().flat_map(|n| n.keys()) {
            if let Some(c) = visit(next, g, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    g.keys()
        .find_map(|m| visit(m, g, &mut Vec::new(), &mut done))
}

#[test]
fn the_top_level_modules_import_one_another_without_a_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let g = graph(&src);
    assert!(
        g.contains_key("proxy") && g["proxy"].contains_key("gateway"),
        "the graph is read"
    );
    if let Some(c) = cycle(&g) {
        let how: Vec<String> = c
            .windows(2)
            .map(|w| format!("{} -> {} ({:?})", w[0], w[1], g[&w[0]][&w[1]]))
            .collect();
        panic!("import cycle: {}", how.join("; "));
    }
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let mut g: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for (a, b) in [
        ("gateway", "upstream"),
        ("upstream", "proxy"),
        ("proxy", "gateway"),
    ] {
        g.entry(a.into())
            .or_default()
            .insert(b.into(), BTreeSet::new());
    }
    assert_eq!(cycle(&g).map(|c| c.len()), Some(4));
    g.get_mut("proxy").unwrap().clear();
    assert_eq!(cycle(&g), None);
    let modules: BTreeSet<String> = ["gateway", "upstream"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let refs = references(
        &code("use crate::{gateway::Gateway, clock};\n// crate::upstream in a comment\nlet x = crate::upstream::Tier;"),
        &modules,
    );
    assert_eq!(
        refs.into_iter().collect::<Vec<_>>(),
        ["gateway", "upstream"]
    );
}

/// Every path of `code` that starts at `crate::`, `super::` or `self::`, as
/// its segments (`{a, b::c}` groups expanded, nested ones too).
fn paths(code: &str) -> Vec<Vec<String>> {
    fn ident(s: &str) -> (&str, &str) {
        let end = s
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(s.len());
        s.split_at(end)
    }
    /// The paths of `s` (after a `::`) below `prefix`; returns what is left.
    fn tail<'a>(mut s: &'a str, prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> &'a str {
        let mut path = prefix;
        loop {
            s = s.trim_start();
            if let Some(group) = s.strip_prefix('{') {
                let mut rest = group;
                loop {
                    rest = tail(rest, path.clone(), out).trim_start();
                    match rest.chars().next() {
                        Some(',') => rest = &rest[1..],
                        Some('}') => return &rest[1..],
                        _ => return rest,
                    }
                }
            }
            let (name, rest) = ident(s);
            if name.is_empty() {
                out.push(path);
                return s;
            }
            path.push(name.to_string());
            match rest.strip_prefix("::") {
                Some(more) => s = more,
                None => {
                    out.push(path);
                    return rest;
                }
            }
        }
    }
    let mut out = Vec::new();
    for start in ["crate::", "super::", "self::"] {
        for (i, _) in code.match_indices(start) {
            let before = code[..i].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue; // part of a longer path (`super::super::`), read from its start
            }
            let mut segments = vec![start.trim_end_matches("::").to_string()];
            let mut rest = &code[i + start.len()..];
            while let Some(more) = rest.strip_prefix("super::") {
                segments.push("super".into());
                rest = more;
            }
            tail(rest, segments, &mut out);
        }
    }
    out
}

/// The module a source file is (`src/affinity/prefix/mod.rs` is
/// `affinity::prefix`), as segments.
fn module_of(rel: &str) -> Vec<String> {
    let rel = rel.trim_end_matches(".rs");
    let mut m: Vec<String> = rel.split('/').map(str::to_string).collect();
    if m.last()
        .is_some_and(|l| l == "mod" || l == "lib" || l == "main")
    {
        m.pop();
    }
    m
}

/// Where `path`, written in module `from`, leads: the deepest module of
/// `modules` it names, and the rest (an item, if any).
fn resolve(
    from: &[String],
    path: &[String],
    modules: &BTreeSet<Vec<String>>,
) -> (Vec<String>, Vec<String>) {
    let mut at: Vec<String> = Vec::new();
    let mut rest = path;
    match path.first().map(String::as_str) {
        Some("crate") => rest = &path[1..],
        Some("self") | Some("super") => {
            at = from.to_vec();
            rest = &path[1..];
            if path[0] == "super" {
                at.pop();
            }
            while rest.first().is_some_and(|s| s == "super") {
                at.pop();
                rest = &rest[1..];
            }
        }
        _ => {}
    }
    while let Some(next) = rest.first() {
        let mut deeper = at.clone();
        deeper.push(next.clone());
        if !modules.contains(&deeper) {
            break;
        }
        at = deeper;
        rest = &rest[1..];
    }
    (at, rest.to_vec())
}

/// A module's path, as segments.
type Module = Vec<String>;

/// Where one of a file's paths leads: a module, and the item named there.
type Reach = (Module, Vec<String>);

/// Every source file's module and where its code's paths lead.
fn module_graph(src: &Path) -> Vec<(Module, Vec<Reach>)> {
    let mut files = Vec::new();
    walk(src, &mut files);
    let rels: Vec<String> = files
        .iter()
        .map(|f| f.strip_prefix(src).unwrap().to_string_lossy().to_string())
        .collect();
    let mut modules: BTreeSet<Vec<String>> = rels.iter().map(|r| module_of(r)).collect();
    // Every ancestor of a file's module is a module (a folder's mod.rs).
    for m in modules.clone() {
        for n in 1..m.len() {
            modules.insert(m[..n].to_vec());
        }
    }
    files
        .iter()
        .zip(&rels)
        .map(|(f, rel)| {
            let from = module_of(rel);
            let text = code(&std::fs::read_to_string(f).unwrap());
            let to = paths(&text)
                .iter()
                .map(|p| resolve(&from, p, &modules))
                .collect();
            (from, to)
        })
        .collect()
}

#[test]
fn no_module_of_the_router_imports_from_the_module_that_holds_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = module_graph(&src);
    let mut arrows: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    let mut seen = 0;
    for (from, to) in &graph {
        if from.first().map(String::as_str) != Some("affinity") {
            continue;
        }
        seen += 1;
        for (target, item) in to {
            if target.first().map(String::as_str) != Some("affinity") || target == from {
                continue;
            }
            assert!(
                !from.starts_with(target),
                "{} imports {} from {}, which holds it: import it from the module that defines it",
                from.join("::"),
                item.join("::"),
                target.join("::")
            );
            arrows
                .entry(from.join("::"))
                .or_default()
                .entry(target.join("::"))
                .or_default()
                .insert(item.join("::"));
        }
    }
    assert!(seen > 15, "the router's files are read");
    assert!(
        arrows["affinity::prefix::conversation"].contains_key("affinity::prefix::prompt"),
        "sibling arrows are seen: {arrows:?}"
    );
    if let Some(c) = cycle(&arrows) {
        panic!("import cycle inside the router: {}", c.join(" -> "));
    }
}

/// The session router (`affinity::Affinity`) is the only way to a route: no
/// code outside `src/affinity/` names the binding table or its workings;
/// what it may name of the table's module are the plain facts a binding is.
#[test]
fn the_binding_table_is_reached_only_through_the_router() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let facts = ["Binding", "BindingKey", "MAX_BACKENDS", "MAX_TIERS"];
    let mut read = 0;
    for (from, to) in module_graph(&src) {
        if from.first().map(String::as_str) == Some("affinity") {
            continue;
        }
        read += 1;
        for (target, item) in to {
            if target == ["affinity", "table"] {
                assert!(
                    item.len() == 1 && facts.contains(&item[0].as_str()),
                    "{} reaches the binding table (`affinity::table::{}`): go through affinity::Affinity",
                    from.join("::"),
                    item.join("::")
                );
            }
        }
    }
    assert!(read > 10, "the sources are read");
}

#[test]
fn paths_are_read_as_the_compiler_reads_them() {
    let p = paths(
        "use super::{table::{Binding, BindingKey}, hrw};\nlet x = crate::affinity::Candidate::default();\nuse super::super::route::Reason;",
    );
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert!(p.contains(&s(&["super", "table", "Binding"])), "{p:?}");
    assert!(p.contains(&s(&["super", "table", "BindingKey"])));
    assert!(p.contains(&s(&["super", "hrw"])));
    assert!(p.contains(&s(&["crate", "affinity", "Candidate", "default"])));
    assert!(p.contains(&s(&["super", "super", "route", "Reason"])));
    let modules: BTreeSet<Vec<String>> = [
        s(&["affinity"]),
        s(&["affinity", "prefix"]),
        s(&["affinity", "prefix", "prompt"]),
        s(&["affinity", "route"]),
    ]
    .into_iter()
    .collect();
    let from = s(&["affinity", "prefix", "conversation"]);
    // A child importing its parent's item leads to the parent...
    let (at, item) = resolve(&from, &s(&["super", "Canon"]), &modules);
    assert_eq!((at, item), (s(&["affinity", "prefix"]), s(&["Canon"])));
    // ...a sibling's, to the sibling.
    let (at, _) = resolve(&from, &s(&["super", "prompt", "Canon"]), &modules);
    assert_eq!(at, s(&["affinity", "prefix", "prompt"]));
    let (at, _) = resolve(&from, &s(&["super", "super", "route", "Reason"]), &modules);
    assert_eq!(at, s(&["affinity", "route"]));
}
