//! The module graphs of the library and of the models crate have no cycles: not between files, not between top-level
//! folders. Built from the sources: every `crate::…` / `super::…` path outside comments and
//! `#[cfg(test)]` modules is an edge to the module file it names, and a `mod child;` is an
//! edge from the parent to the child. So a child that imports from its parent's `mod.rs`
//! while the parent declares it is a cycle: shared items live in their own file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module path (`crate::gemv::cuda`) of every source file under `root` (a crate's `src/`;
/// `src/bin/` holds other crates and is skipped).
fn modules(root: &Path) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                if p != root.join("bin") {
                    stack.push(p);
                }
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let rel = p.strip_prefix(root).unwrap().with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().to_string())
                .collect();
            if parts.last().is_some_and(|s| s == "mod" || s == "lib") {
                parts.pop();
            }
            let name = std::iter::once("crate".to_string())
                .chain(parts)
                .collect::<Vec<_>>()
                .join("::");
            out.insert(name, p);
        }
    }
    out
}

/// The paths a line names after `crate::` or `super::` (braces expanded one level).
fn paths_in(line: &str, module: &str) -> Vec<String> {
    let mut out = Vec::new();
    let parent = module
        .rsplit_once("::")
        .map_or("crate", |(p, _)| p)
        .to_string();
    for (kw, base) in [("crate::", "crate".to_string()), ("super::", parent)] {
        let mut rest = line;
        while let Some(i) = rest.find(kw) {
            let before = rest[..i].chars().last();
            rest = &rest[i + kw.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(rest.len());
            let head = rest[..end].trim_end_matches(':');
            let full = |p: &str| {
                let p = p.trim().trim_end_matches(':');
                if p.is_empty() {
                    base.clone()
                } else {
                    format!("{base}::{p}")
                }
            };
            if rest[end..].starts_with('{') {
                let inner = &rest[end + 1..];
                let close = inner.find('}').unwrap_or(inner.len());
                for item in inner[..close].split(',') {
                    let item = item.trim().split(" as ").next().unwrap_or("").trim();
                    let joined = if head.is_empty() {
                        item.to_string()
                    } else {
                        format!("{head}::{item}")
                    };
                    out.push(full(&joined));
                }
            } else {
                out.push(full(head));
            }
        }
    }
    out
}

/// The module file a path lands in: its longest prefix that is a module.
fn resolve(path: &str, mods: &BTreeMap<String, PathBuf>) -> Option<String> {
    let mut p = path.to_string();
    loop {
        if mods.contains_key(&p) {
            return Some(p);
        }
        p = p.rsplit_once("::")?.0.to_string();
    }
}

fn edges(mods: &BTreeMap<String, PathBuf>) -> BTreeMap<String, BTreeSet<String>> {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, file) in mods {
        let text = std::fs::read_to_string(file).unwrap();
        let e = g.entry(m.clone()).or_default();
        for line in text.lines() {
            let l = line.trim();
            if l.starts_with("#[cfg(test)]") {
                break;
            }
            if l.starts_with("//") {
                continue;
            }
            let decl = l
                .trim_start_matches("pub(crate) ")
                .trim_start_matches("pub ");
            if let Some(name) = decl.strip_prefix("mod ").and_then(|s| s.strip_suffix(';')) {
                e.insert(format!("{m}::{name}"));
            }
            for p in paths_in(l, m) {
                if let Some(t) = resolve(&p, mods) {
                    if &t != m {
                        e.insert(t);
                    }
                }
            }
        }
    }
    g
}

/// A cycle of `g`, if it has one.
fn find_cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        stack.push(n.to_string());
        for t in g.get(n).into_iter().flatten() {
            match state.get(t.as_str()).copied().unwrap_or(0) {
                1 => {
                    let i = stack.iter().position(|s| s == t).unwrap_or(0);
                    let mut c = stack[i..].to_vec();
                    c.push(t.clone());
                    return Some(c);
                }
                0 => {
                    if let Some(c) = visit(t, g, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in g.keys() {
        if state.get(n.as_str()).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(n, g, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

/// The module graph of the library (`src`) or the models crate (`models/src`).
fn src_graph(krate: &str) -> BTreeMap<String, BTreeSet<String>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(krate);
    edges(&modules(&root))
}

/// `lib.rs` only declares modules and re-exports (so no item of the crate lives there).
#[test]
fn lib_rs_defines_nothing() {
    for krate in ["src", "models/src"] {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(krate)
            .join("lib.rs");
        for l in std::fs::read_to_string(&p).unwrap().lines() {
            let l = l
                .trim_start_matches("pub ")
                .trim_start_matches("pub(crate) ");
            for kw in [
                "fn ", "struct ", "enum ", "const ", "static ", "type ", "impl ", "trait ",
            ] {
                assert!(!l.starts_with(kw), "{}: `{l}`", p.display());
            }
        }
    }
}

#[test]
fn no_cycle_between_files() {
    for krate in ["src", "models/src"] {
        let g = src_graph(krate);
        assert!(g.len() > 20, "{krate}: found only {} modules", g.len());
        if let Some(c) = find_cycle(&g) {
            panic!("{krate}: import cycle between files: {}", c.join(" -> "));
        }
    }
}

#[test]
fn no_cycle_between_folders() {
    for krate in ["src", "models/src"] {
        folder_cycles(krate);
    }
}

fn folder_cycles(krate: &str) {
    let top = |m: &str| m.split("::").take(2).collect::<Vec<_>>().join("::");
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (a, ts) in src_graph(krate) {
        if a == "crate" {
            continue; // lib.rs declares every folder
        }
        for t in ts {
            if top(&t) != top(&a) && t != "crate" {
                g.entry(top(&a)).or_default().insert(top(&t));
            }
        }
    }
    if let Some(c) = find_cycle(&g) {
        panic!("{krate}: import cycle between folders: {}", c.join(" -> "));
    }
}

/// The checker itself finds a cycle (a test that can't fail is a defect): two files that
/// import each other, and a child importing its parent's `mod.rs`.
#[test]
fn checker_finds_cycles() {
    let dir = std::env::temp_dir().join(format!("cfp4_modgraph_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("a")).unwrap();
    std::fs::write(dir.join("lib.rs"), "mod a;\nmod b;\n").unwrap();
    std::fs::write(dir.join("a/mod.rs"), "mod c;\npub struct T;\n").unwrap();
    std::fs::write(dir.join("a/c.rs"), "use super::T;\n").unwrap();
    std::fs::write(dir.join("b.rs"), "use crate::a::T;\n").unwrap();
    let g = edges(&modules(&dir));
    let c = find_cycle(&g).expect("a child importing its parent is a cycle");
    assert!(c.contains(&"crate::a::c".to_string()), "{c:?}");
    std::fs::write(dir.join("a/c.rs"), "pub struct U;\n").unwrap();
    assert_eq!(find_cycle(&edges(&modules(&dir))), None);
    std::fs::write(dir.join("a/c.rs"), "use crate::b::X; // a -> c -> b\n").unwrap();
    std::fs::write(
        dir.join("b.rs"),
        "pub struct X;\nuse crate::a::{T, c::U};\n",
    )
    .unwrap();
    assert!(find_cycle(&edges(&modules(&dir))).is_some());
    let _ = std::fs::remove_dir_all(&dir);
}
