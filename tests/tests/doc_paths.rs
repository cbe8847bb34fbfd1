//! Every repository path cited in the documentation exists: in README.md, docs/*.md (the
//! reviews under docs/reviews/ are dated records and cite the code of their day) and the
//! `//!` and `///` comments of every crate. A path counts as cited when it starts with a
//! top-level directory of the repository (`controller/src/…`, `lab/examples/…`, `docs/…`);
//! in a comment it may also be relative to its crate (`examples/…` in `lab` is `lab/examples/…`).
//! Patterns (`{a,b}.rs`, `*`, `<name>`) and line numbers (`:120`) are not paths; absolute
//! paths (`/sys/fs/cgroup/…`, `/proc/…`) are the host's, not the repository's.

use std::path::{Path, PathBuf};

/// Words shaped like a cited path that name something else.
const NOT_PATHS: [&str; 1] = [
    // A Kubernetes API group and version.
    "core/v1",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate is in the repository")
        .to_path_buf()
}

/// The repository's top-level directories (not hidden ones but `.ci`, nor `target`).
fn top_dirs(repo: &Path) -> Vec<String> {
    let mut dirs: Vec<String> = std::fs::read_dir(repo)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| (!n.starts_with('.') || n == ".ci") && n != "target")
        .collect();
    dirs.sort();
    dirs
}

fn path_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | '-')
}

/// The repository paths cited in `line`: a top-level directory and `/`, not preceded by a
/// path character, up to the first character that cannot be in a path.
fn citations(line: &str, tops: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in line.char_indices() {
        if line[..i].chars().next_back().is_some_and(path_char) {
            continue;
        }
        let rest = &line[i..];
        if !tops.iter().any(|t| rest.starts_with(&format!("{t}/"))) {
            continue;
        }
        let len = rest.find(|c: char| !path_char(c)).unwrap_or(rest.len());
        if rest[len..].starts_with(['{', '*', '<']) {
            continue; // a pattern
        }
        let path = rest[..len].trim_end_matches(['.', ',', ':']);
        if !NOT_PATHS.contains(&path) {
            out.push(path.to_string());
        }
    }
    out
}

/// The `.rs` files of the crates, with their crate's directory.
fn rust_files(repo: &Path, tops: &[String]) -> Vec<(PathBuf, PathBuf)> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    for t in tops {
        let dir = repo.join(t);
        if dir.join("Cargo.toml").is_file() {
            let mut files = Vec::new();
            walk(&dir, &mut files);
            out.extend(files.into_iter().map(|f| (f, dir.clone())));
        }
    }
    out
}

#[test]
fn every_repository_path_cited_in_docs_and_doc_comments_exists() {
    let repo = repo();
    let tops = top_dirs(&repo);
    let mut dead = Vec::new();
    let mut docs = vec![repo.join("README.md")];
    for e in std::fs::read_dir(repo.join("docs")).unwrap().flatten() {
        if e.path().extension().is_some_and(|x| x == "md") {
            docs.push(e.path());
        }
    }
    let mut checked = 0;
    for doc in &docs {
        let text = std::fs::read_to_string(doc).unwrap();
        for (n, line) in text.lines().enumerate() {
            for p in citations(line, &tops) {
                checked += 1;
                if !repo.join(&p).exists() {
                    dead.push(format!("{}:{}: {p}", doc.display(), n + 1));
                }
            }
        }
    }
    for (file, krate) in rust_files(&repo, &tops) {
        let text = std::fs::read_to_string(&file).unwrap();
        for (n, line) in text.lines().enumerate() {
            let l = line.trim_start();
            if !(l.starts_with("//!") || l.starts_with("///")) {
                continue;
            }
            for p in citations(l, &tops) {
                checked += 1;
                if !repo.join(&p).exists() && !krate.join(&p).exists() {
                    dead.push(format!("{}:{}: {p}", file.display(), n + 1));
                }
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} citations found: the scan is broken"
    );
    assert!(
        dead.is_empty(),
        "cited paths that do not exist:\n{}",
        dead.join("\n")
    );
}

#[test]
fn a_citation_is_a_top_level_directory_and_a_path_without_patterns_or_line_numbers() {
    let tops = [
        "controller".to_string(),
        "docs".to_string(),
        "core".to_string(),
    ];
    assert_eq!(
        citations(
            "see `controller/src/daemon/host/apply.rs:262` and [x](docs/STYLE.md).",
            &tops
        ),
        ["controller/src/daemon/host/apply.rs", "docs/STYLE.md"]
    );
    assert!(citations("controller/src/daemon/{config,gpu}.rs", &tops).is_empty());
    assert!(citations("/sys/fs/cgroup/cpuset and lab/examples/x.rs", &tops).is_empty());
    assert!(citations("the core/v1 Events", &tops).is_empty());
    assert!(citations("cohabit-core/src/lib.rs", &tops).is_empty());
}
