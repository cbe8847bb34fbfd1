//! Every citation of a section, `docs/<name>.md, "Heading"` (the comma may be left out),
//! names a heading that the document has: the quoted text is the start of one of them. Cited
//! in README.md, docs/*.md (not the dated reviews under docs/reviews/), the `.rs` files of
//! every crate (any comment), the scenario files and the scripts. A citation may run over
//! lines: a line break with the next line's comment marker (`//!`, `///`, `//`, `#`) reads
//! as one space. docs/RESULTS.md is generated (scripts/results.sh) and docs/EXPERIMENTS.md
//! holds its history, so a section that moves from one to the other leaves citations
//! behind; this finds them.

use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate is in the repository")
        .to_path_buf()
}

/// The files whose citations are checked, relative to the repository.
fn cited_in(repo: &Path) -> Vec<PathBuf> {
    fn walk(repo: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            let rel = p.strip_prefix(repo).unwrap().to_path_buf();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() {
                if !name.starts_with('.') && name != "target" && rel != Path::new("docs/reviews") {
                    walk(repo, &p, out);
                }
            } else if ["rs", "md", "toml", "sh"]
                .iter()
                .any(|x| p.extension().is_some_and(|e| e == *x))
            {
                out.push(rel);
            }
        }
    }
    let mut out = Vec::new();
    walk(repo, repo, &mut out);
    out.sort();
    out
}

/// The headings of a markdown text (outside code blocks), without their `#`s.
fn headings(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut code = false;
    for line in text.lines() {
        if line.starts_with("```") {
            code = !code;
        } else if !code && line.starts_with('#') {
            let h = line.trim_start_matches('#');
            if h.starts_with(' ') {
                out.push(h.trim().to_string());
            }
        }
    }
    out
}

/// Skips spaces and line breaks; after a line break, the next line's comment marker too.
fn skip_space(s: &str) -> &str {
    let mut s = s;
    loop {
        let t = s.trim_start_matches([' ', '\t']);
        match t.strip_prefix('\n') {
            Some(rest) => {
                let rest = rest.trim_start_matches([' ', '\t']);
                s = ["//!", "///", "//", "#"]
                    .iter()
                    .find_map(|m| rest.strip_prefix(m))
                    .unwrap_or(rest);
            }
            None => return t,
        }
    }
}

/// The section citations in `text`: (line, the cited file under docs/, the quoted text
/// with its line breaks and comment markers read as single spaces).
fn citations(text: &str) -> Vec<(usize, String, String)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = text[from..].find("docs/") {
        let at = from + i;
        from = at + 5;
        let before = text[..at].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || matches!(c, '/' | '_' | '-')) {
            continue;
        }
        let rest = &text[at + 5..];
        let name_len = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
            .unwrap_or(rest.len());
        let name = &rest[..name_len];
        if !name.ends_with(".md") {
            continue;
        }
        let after = &rest[name_len..];
        let after = after.strip_prefix(',').unwrap_or(after);
        if !after.starts_with(char::is_whitespace) {
            continue; // `"docs/X.md", "…"` in code is no citation
        }
        let after = skip_space(after);
        let Some(quoted) = after.strip_prefix('"') else {
            continue;
        };
        let Some(end) = quoted.find('"') else {
            continue;
        };
        let mut cited = String::new();
        let mut q = &quoted[..end];
        while !q.is_empty() {
            let word_end = q.find(char::is_whitespace).unwrap_or(q.len());
            if !cited.is_empty() {
                cited.push(' ');
            }
            cited.push_str(&q[..word_end]);
            q = skip_space(&q[word_end..]);
            q = q.trim_start();
        }
        let line = text[..at].matches('\n').count() + 1;
        out.push((line, name.to_string(), cited));
    }
    out
}

fn names_a_heading(heads: &[String], cited: &str) -> bool {
    heads.iter().any(|h| h.starts_with(cited))
}

#[test]
fn every_cited_section_is_a_heading_of_the_document_it_names() {
    let repo = repo();
    let mut dead = Vec::new();
    let mut checked = 0;
    for file in cited_in(&repo) {
        let text = std::fs::read_to_string(repo.join(&file)).unwrap();
        for (line, doc, cited) in citations(&text) {
            checked += 1;
            let heads = match std::fs::read_to_string(repo.join("docs").join(&doc)) {
                Ok(t) => headings(&t),
                Err(_) => Vec::new(),
            };
            if names_a_heading(&heads, &cited) {
                continue;
            }
            dead.push(format!(
                "{}:{line}: docs/{doc}, \"{cited}\"",
                file.display()
            ));
        }
    }
    assert!(
        checked > 20,
        "only {checked} section citations found: the scan is broken"
    );
    assert!(
        dead.is_empty(),
        "cited sections that are no heading of the document named:\n{}",
        dead.join("\n")
    );
}

#[test]
fn a_citation_runs_over_comment_lines_and_a_dead_one_is_found() {
    let text = "x (docs/A.md, \"One two\n    /// three\") and docs/B.md \"Four\"; \
                docs/C.md, a list; cohabit-docs/D.md, \"No\"; (\"docs/E.md\", \"No\")";
    assert_eq!(
        citations(text),
        [
            (1, "A.md".to_string(), "One two three".to_string()),
            (2, "B.md".to_string(), "Four".to_string()),
        ]
    );
    let heads = headings("# Top\n\n## One two three (issue 1)\n```\n## not a heading\n```\n");
    assert_eq!(heads, ["Top", "One two three (issue 1)"]);
    assert!(names_a_heading(&heads, "One two three"));
    assert!(!names_a_heading(&heads, "not a heading"));
    assert!(!names_a_heading(&heads, "Two three"));
}
