//! The generated blocks of `docs/performance.md`: each scenario's `section.md` between its
//! `<!-- bench:NAME:begin -->` and `<!-- bench:NAME:end -->` markers; the text around them
//! is written by hand and kept.

use std::path::Path;

use anyhow::Context as _;

/// Replaces the blocks of the scenarios in `ran` that have a section under `results`.
pub fn update(doc: &Path, results: &Path, ran: &[&str]) -> anyhow::Result<()> {
    if !doc.is_file() {
        eprintln!(
            "suite: no {} here; tables left in the results",
            doc.display()
        );
        return Ok(());
    }
    let mut text =
        std::fs::read_to_string(doc).with_context(|| format!("cannot read {}", doc.display()))?;
    for name in ran {
        let Ok(section) = std::fs::read_to_string(results.join(name).join("section.md")) else {
            continue;
        };
        match replace_block(&text, name, &section) {
            Some(updated) => text = updated,
            None => eprintln!(
                "suite: no <!-- bench:{name}:begin/end --> markers in {}; section left out",
                doc.display()
            ),
        }
    }
    std::fs::write(doc, text).with_context(|| format!("cannot write {}", doc.display()))
}

/// `text` with the block of `name` replaced by `section`; `None` without its markers.
pub fn replace_block(text: &str, name: &str, section: &str) -> Option<String> {
    let begin = format!("<!-- bench:{name}:begin -->");
    let end = format!("<!-- bench:{name}:end -->");
    let start = text.find(&begin)?;
    let stop = start + text[start..].find(&end)?;
    Some(format!(
        "{}{begin}\n{}\n{}",
        &text[..start],
        section.trim_end(),
        &text[stop..]
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_named_block_changes() {
        let text = "intro\n<!-- bench:a:begin -->\nold a\n<!-- bench:a:end -->\nmiddle\n\
                    <!-- bench:b:begin -->\nold b\n<!-- bench:b:end -->\nend\n";
        let updated = replace_block(text, "a", "new a\n\n").unwrap();
        assert_eq!(
            updated,
            "intro\n<!-- bench:a:begin -->\nnew a\n<!-- bench:a:end -->\nmiddle\n\
             <!-- bench:b:begin -->\nold b\n<!-- bench:b:end -->\nend\n"
        );
        assert_eq!(replace_block(text, "c", "x"), None);
    }
}
