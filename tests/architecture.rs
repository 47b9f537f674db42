//! The layering of `src`: no import cycle among the crate's top-level
//! modules. Lower layers (clock, metrics, affinity, config, upstream, the
//! gateway's state) must not know the ones above them (the fleet, the proxy,
//! services, the server); a cycle means a concept has no single owner.

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

/// The session router (`affinity::Affinity`) is the only way to a route: no
/// code outside `src/affinity/` reaches the binding table itself.
#[test]
fn the_binding_table_is_reached_only_through_the_router() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    walk(&src, &mut files);
    let mut read = 0;
    for f in files {
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().to_string();
        if rel.starts_with("affinity/") {
            continue;
        }
        read += 1;
        let text = code(&std::fs::read_to_string(&f).unwrap());
        for reach in ["BindingTable", ".table()"] {
            assert!(
                !text.contains(reach),
                "{rel} reaches the binding table ({reach}): go through affinity::Affinity"
            );
        }
    }
    assert!(read > 10, "the sources are read");
}
