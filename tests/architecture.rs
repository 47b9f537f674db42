//! The layering of `src`, read from every line of every file (tests
//! included):
//! - in every folder, the modules it holds import one another without a
//!   cycle (the crate's top-level modules are the first folder): a cycle
//!   means a concept has no single owner;
//! - no module imports from a module that holds it (a folder's `mod.rs` is
//!   its face and its children are its parts). A file's own `#[cfg(test)]`
//!   module (inline, or a `tests` folder) may use the module it tests,
//!   nothing above it.
//!
//! Privacy (the binding table reached only through the router, a phase's
//! state only through its owner) is the compiler's: `pub(crate)` and
//! private modules, not a search of the text.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path, as segments (`["affinity", "prefix"]`).
type Module = Vec<String>;

/// `text` with its comments and the insides of its string and character
/// literals blanked (same length, same lines): what is left is paths,
/// braces and code.
fn lex(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = b.to_vec();
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                let end = b[i..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .map_or(b.len(), |p| i + p);
                blank(&mut out, i, end);
                i = end;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let mut depth = 0;
                let start = i;
                while i < b.len() {
                    if b[i..].starts_with(b"/*") {
                        depth += 1;
                        i += 2;
                    } else if b[i..].starts_with(b"*/") {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
                blank(&mut out, start, i);
            }
            b'r' if (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) =>
            {
                // A raw string: r"…", r#"…"#.
                let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
                if b.get(i + 1 + hashes) != Some(&b'"') {
                    i += 1;
                    continue;
                }
                let body = i + 2 + hashes;
                let mut close = b"\"".to_vec();
                close.extend(std::iter::repeat_n(b'#', hashes));
                let end = b[body..]
                    .windows(close.len())
                    .position(|w| w == close.as_slice())
                    .map_or(b.len(), |p| body + p);
                blank(&mut out, body, end);
                i = end + close.len();
            }
            b'"' => {
                let start = i + 1;
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                blank(&mut out, start, i.min(b.len()));
                i += 1;
            }
            b'\'' => {
                // A character literal ('x', '\n', '\u{..}'), not a lifetime.
                let end = if b.get(i + 1) == Some(&b'\\') {
                    b[i + 2..]
                        .iter()
                        .position(|&c| c == b'\'')
                        .map(|p| i + 2 + p)
                } else {
                    let len = text[i + 1..].chars().next().map_or(1, char::len_utf8);
                    (b.get(i + 1 + len) == Some(&b'\'')).then_some(i + 1 + len)
                };
                match end {
                    Some(end) => {
                        blank(&mut out, i + 1, end);
                        i = end + 1;
                    }
                    None => i += 1,
                }
            }
            _ => i += 1,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One module's code within a file: the file's own, or an inline `mod x {…}`.
struct Region {
    /// The module the code is in (`super::` resolves from here).
    module: Module,
    /// The module the rules hold it to: its own, or for a `#[cfg(test)]`
    /// module, the module it tests.
    owner: Module,
    code: String,
}

/// The regions of a file that is module `module`, from its lexed `code`.
fn regions(module: &Module, code: &str, owner: &Module, out: &mut Vec<Region>) {
    let b = code.as_bytes();
    let mut own = String::with_capacity(code.len());
    let mut i = 0;
    let mut copied = 0;
    while let Some(at) = code[i..].find("mod ").map(|p| i + p) {
        i = at + 4;
        if at > 0 && (b[at - 1].is_ascii_alphanumeric() || b[at - 1] == b'_') {
            continue;
        }
        let rest = &code[at + 4..];
        let name: String = rest
            .trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let after = rest.trim_start()[name.len()..].trim_start();
        if name.is_empty() || !after.starts_with('{') {
            continue; // `mod x;`: a file of its own
        }
        let open = code.len() - after.len();
        let mut depth = 0;
        let mut close = code.len();
        for (j, c) in code[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        close = open + j;
                        break;
                    }
                }
                _ => {}
            }
        }
        let before = code[..at].trim_end();
        let before = ["pub(crate)", "pub(super)", "pub"]
            .iter()
            .find_map(|v| before.strip_suffix(v))
            .unwrap_or(before);
        let test = before.trim_end().ends_with("#[cfg(test)]");
        let mut inner = module.clone();
        inner.push(name);
        let inner_owner = if test { owner.clone() } else { inner.clone() };
        regions(&inner, &code[open + 1..close], &inner_owner, out);
        own.push_str(&code[copied..at]);
        copied = close.min(code.len());
        i = copied;
    }
    own.push_str(&code[copied..]);
    out.push(Region {
        module: module.clone(),
        owner: owner.clone(),
        code: own,
    });
}

fn walk(dir: &Path, files: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            walk(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
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
            if code[..i].trim_end().ends_with("(in") {
                continue; // a visibility (`pub(in crate::x)`), not a use
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
fn module_of(rel: &str) -> Module {
    let rel = rel.trim_end_matches(".rs");
    let mut m: Module = rel.split('/').map(str::to_string).collect();
    if m.last()
        .is_some_and(|l| l == "mod" || l == "lib" || l == "main")
    {
        m.pop();
    }
    m
}

/// Where `path`, written in module `from`, leads: the deepest module of
/// `modules` it names, and the rest (an item, if any).
fn resolve(from: &[String], path: &[String], modules: &BTreeSet<Module>) -> (Module, Vec<String>) {
    let mut at: Module = Vec::new();
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

/// Where one of a region's paths leads: a module, and the item named there.
type Reach = (Module, Vec<String>);

/// Every region of every source file under `src`, with where its paths lead.
fn module_graph(src: &Path) -> Vec<(Region, Vec<Reach>)> {
    let mut files = Vec::new();
    walk(src, &mut files);
    let mut all = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(src).unwrap().to_string_lossy().to_string();
        if rel == "main.rs" {
            continue; // the binary, a crate of its own
        }
        let module = module_of(&rel);
        let code = lex(&std::fs::read_to_string(f).unwrap());
        // A folder of tests (`affinity/tests/`) is held to what it tests.
        let owner = match module.iter().position(|m| m == "tests") {
            Some(at) => module[..at].to_vec(),
            None => module.clone(),
        };
        regions(&module, &code, &owner, &mut all);
    }
    let modules: BTreeSet<Module> = all
        .iter()
        .flat_map(|r| (1..=r.module.len()).map(|n| r.module[..n].to_vec()))
        .collect();
    all.into_iter()
        .map(|r| {
            let to = paths(&r.code)
                .iter()
                .map(|p| resolve(&r.module, p, &modules))
                .collect();
            (r, to)
        })
        .collect()
}

type Arrows = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

/// A cycle through the graph, as its modules in order, if there is one.
fn cycle(g: &Arrows) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        g: &Arrows,
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

/// Folder → (child → (child it imports → the modules that do)): each
/// arrow between two modules, drawn between the children of every folder
/// that holds both.
fn folder_arrows(graph: &[(Region, Vec<Reach>)]) -> BTreeMap<String, Arrows> {
    let mut folders: BTreeMap<String, Arrows> = BTreeMap::new();
    for (r, to) in graph {
        for (target, _) in to {
            let from = &r.owner;
            let common = from.iter().zip(target).take_while(|(a, b)| a == b).count();
            if common == from.len() || common == target.len() {
                continue; // within one module, or up or down its own line
            }
            let folder = match common {
                0 => "crate".to_string(),
                n => from[..n].join("::"),
            };
            folders
                .entry(folder)
                .or_default()
                .entry(from[common].clone())
                .or_default()
                .entry(target[common].clone())
                .or_default()
                .insert(from.join("::"));
        }
    }
    folders
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn in_every_folder_the_modules_import_one_another_without_a_cycle() {
    let graph = module_graph(&src());
    let folders = folder_arrows(&graph);
    assert!(
        folders["crate"]["proxy"].contains_key("gateway"),
        "the top-level graph is read"
    );
    assert!(
        folders["affinity::prefix"]["conversation"].contains_key("prompt"),
        "sibling arrows are seen"
    );
    for (folder, g) in &folders {
        if let Some(c) = cycle(g) {
            let how: Vec<String> = c
                .windows(2)
                .map(|w| format!("{} -> {} ({:?})", w[0], w[1], g[&w[0]][&w[1]]))
                .collect();
            panic!("import cycle in {folder}: {}", how.join("; "));
        }
    }
}

#[test]
fn no_module_imports_from_a_module_that_holds_it() {
    let graph = module_graph(&src());
    let mut read = 0;
    let mut wrong = Vec::new();
    for (r, to) in &graph {
        read += 1;
        for (target, item) in to {
            if !target.is_empty() && target.len() < r.owner.len() && r.owner.starts_with(target) {
                wrong.push(format!(
                    "{} imports {} from {}, which holds it: import it from the module that defines it",
                    r.module.join("::"),
                    item.join("::"),
                    target.join("::")
                ));
            }
        }
    }
    assert!(read > 80, "the sources are read ({read} regions)");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The functions of `code` with a body: name, first line (from `line0`)
/// and length in lines.
fn functions(code: &str, line0: usize) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    for (at, _) in code.match_indices("fn ") {
        if at > 0 && code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let name: String = code[at + 3..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let rest = &code[at..];
        let (Some(open), semi) = (rest.find('{'), rest.find(';')) else {
            continue;
        };
        if name.is_empty() || semi.is_some_and(|s| s < open) {
            continue; // a declaration without a body
        }
        let mut depth = 0;
        let mut end = rest.len();
        for (j, c) in rest[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + j;
                        break;
                    }
                }
                _ => {}
            }
        }
        let first = line0 + code[..at].matches('\n').count();
        out.push((name, first, rest[..end].matches('\n').count() + 1));
    }
    out
}

/// The request's path — its phases, its route, admission and the session
/// router — reads from one function down: no function of it (tests aside)
/// is longer than about a hundred lines.
#[test]
fn no_function_on_the_requests_path_is_longer_than_about_a_hundred_lines() {
    const MOST: usize = 110;
    let mut files = Vec::new();
    for folder in ["proxy", "routing", "admission", "affinity"] {
        walk(&src().join(folder), &mut files);
    }
    let mut long = Vec::new();
    let mut seen = 0;
    for f in &files {
        let rel = f.strip_prefix(src()).unwrap().to_string_lossy().to_string();
        if rel.contains("/tests/") {
            continue;
        }
        let module = module_of(&rel);
        let mut regions_of = Vec::new();
        regions(
            &module,
            &lex(&std::fs::read_to_string(f).unwrap()),
            &module,
            &mut regions_of,
        );
        for r in regions_of.iter().filter(|r| r.owner == r.module) {
            for (name, line, len) in functions(&r.code, 1) {
                seen += 1;
                if len > MOST {
                    long.push(format!(
                        "{rel}: fn {name} (around line {line}) is {len} lines"
                    ));
                }
            }
        }
    }
    assert!(seen > 300, "the functions are read ({seen})");
    assert!(
        long.is_empty(),
        "split by what each part decides:\n{}",
        long.join("\n")
    );
}

#[test]
fn functions_are_measured_from_their_name_to_their_closing_brace() {
    let code = lex("fn a() {\n    let s = \"}\";\n}\ntrait T { fn decl(&self); }\nfn b() -> X { Y { z: 1 } }\n");
    let found: Vec<(String, usize)> = functions(&code, 1)
        .into_iter()
        .map(|(n, _, l)| (n, l))
        .collect();
    assert_eq!(found, vec![("a".to_string(), 3), ("b".to_string(), 1)]);
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let mut g = Arrows::new();
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
}

#[test]
fn a_file_is_read_whole_comments_and_strings_aside() {
    let text = r##"
use crate::gateway::Gateway; // crate::upstream in a comment
const S: &str = "crate::metrics { mod fake {";
const R: &str = r#"crate::trace"#;
const C: char = '{';
fn f<'a>(x: &'a str) -> &'a str { x }
/* crate::clock */
#[cfg(test)]
mod tests {
    use super::*;
    use crate::affinity::Affinity;
    mod deeper { use super::super::x; }
}
fn after() { crate::admission::Class::Batch; }
"##;
    let module: Module = vec!["proxy".into(), "peer".into()];
    let mut out = Vec::new();
    regions(&module, &lex(text), &module, &mut out);
    let by_module: BTreeMap<String, (&Region, Vec<Vec<String>>)> = out
        .iter()
        .map(|r| (r.module.join("::"), (r, paths(&r.code))))
        .collect();
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let (top, top_paths) = &by_module["proxy::peer"];
    assert_eq!(top.owner, module);
    assert_eq!(
        top_paths,
        &vec![
            s(&["crate", "gateway", "Gateway"]),
            s(&["crate", "admission", "Class", "Batch"])
        ],
        "the code after a test module is read; comments and strings are not"
    );
    let (tests, test_paths) = &by_module["proxy::peer::tests"];
    assert_eq!(
        tests.owner, module,
        "a test module is held to what it tests"
    );
    assert!(test_paths.contains(&s(&["crate", "affinity", "Affinity"])));
    let (deeper, _) = &by_module["proxy::peer::tests::deeper"];
    assert_eq!(
        deeper.owner, deeper.module,
        "an inner non-test module is its own"
    );
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
    let modules: BTreeSet<Module> = [
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
