//! Text one person writes for another to read: a force-release reason (the
//! approver reads it before ending someone's hold), an epoch advance's
//! reason. It reaches terminals (`latchctl admin force-release list`,
//! `latchctl audit`), the arbiter's log and the audit store, so it is held
//! to one line of printable characters: a control character could redraw
//! the lines the approver reads (`ESC [1A`, `\r`), hide text (`ESC [8m`) or
//! forge log lines (`\n`), and the bidirectional and zero-width format
//! characters reorder or hide what is shown (CVE-2021-42574's "Trojan
//! Source"). Such text is refused, never cleaned: a cleaned reason would
//! be a reason its writer did not write.

/// Characters that change how the text around them is shown rather than
/// showing themselves: Unicode's whole Cf category (format: bidirectional
/// embeddings, overrides and isolates, zero-width characters, the byte
/// order mark, the tag characters that can carry a hidden message, ...; the
/// same table as `latchkey_policies::key::is_printable`, written out as
/// neither crate carries Unicode tables), line and paragraph separators,
/// the blank Hangul fillers and the variation selectors (invisible, and
/// able to carry hidden bytes after any character).
fn is_format_control(c: char) -> bool {
    matches!(
        u32::from(c),
        0x00AD
            | 0x0600..=0x0605
            | 0x061C
            | 0x06DD
            | 0x070F
            | 0x0890..=0x0891
            | 0x08E2
            | 0x115F..=0x1160
            | 0x180B..=0x180F
            | 0x200B..=0x200F
            | 0x2028..=0x202E
            | 0x2060..=0x2064
            | 0x2066..=0x206F
            | 0x3164
            | 0xFE00..=0xFE0F
            | 0xFEFF
            | 0xFFA0
            | 0xFFF9..=0xFFFB
            | 0x110BD
            | 0x110CD
            | 0x13430..=0x1343F
            | 0x1BCA0..=0x1BCA3
            | 0x1D173..=0x1D17A
            | 0xE0001
            | 0xE0020..=0xE007F
            | 0xE0100..=0xE01EF
    )
}

/// Whether `c` may appear in operator text.
pub fn printable(c: char) -> bool {
    !c.is_control() && !is_format_control(c)
}

/// `text`, trimmed, if it is 1..=`max_bytes` bytes of one line of printable
/// characters; otherwise a message that says what to fix (`what` names the
/// field, e.g. "a force-release reason").
pub fn checked<'a>(text: &'a str, what: &str, max_bytes: usize) -> Result<&'a str, String> {
    let text = text.trim();
    if text.is_empty() || text.len() > max_bytes {
        return Err(format!(
            "{what} must be 1..={max_bytes} bytes (it was {} after trimming)",
            text.len()
        ));
    }
    if let Some((at, c)) = text.char_indices().find(|(_, c)| !printable(*c)) {
        return Err(format!(
            "{what} must be one line of printable text: it has U+{:04X} at byte {at}; \
             control, line-break, bidirectional and zero-width characters are refused \
             because they change what the reader's terminal or log shows",
            u32::from(c)
        ));
    }
    Ok(text)
}

/// Shows text that came from someone else (a reason, a key, an identity, an
/// operator's subject) with every character [`printable`] refuses escaped
/// as `\u{..}`, so a record written before the arbiter checked reasons, or
/// by anything that wrote the store directly, cannot redraw the reader's
/// terminal either. A backslash is shown doubled, so a writer's literal
/// `\u{1b}` never reads like an escaped ESC.
#[derive(Debug, Clone, Copy)]
pub struct Shown<'a>(pub &'a str);

impl std::fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use std::fmt::Write as _;
        for c in self.0.chars() {
            if c == '\\' {
                f.write_str("\\\\")?;
            } else if printable(c) {
                f.write_char(c)?;
            } else {
                write!(f, "{}", c.escape_unicode())?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_passes_trimmed() {
        assert_eq!(
            checked("  stuck since 03:00, INC-42 — ünïcödé ok ", "r", 512),
            Ok("stuck since 03:00, INC-42 — ünïcödé ok")
        );
    }

    #[test]
    fn terminal_and_log_injection_is_refused() {
        for bad in [
            "stuck\u{1b}[1A\u{1b}[2K\rkey          demo/harmless\n\u{1b}[8m",
            "two\nlines",
            "carriage\rreturn",
            "tab\there",
            "bell\u{7}",
            "del\u{7f}",
            "c1\u{9b}31m",
            "bidi \u{202E}gnp.exe",
            "isolate \u{2066}x\u{2069}",
            "zero\u{200B}width",
            "bom\u{FEFF}",
            "line\u{2028}separator",
            "soft\u{AD}hyphen",
            "tags \u{E0068}\u{E0069}",
            "selector \u{FE0F}",
        ] {
            let e = checked(bad, "a force-release reason", 512).unwrap_err();
            assert!(e.contains("U+"), "{e}");
        }
    }

    #[test]
    fn shown_escapes_what_checked_refuses() {
        let raw = "stuck\u{1b}[1A\rkey demo/x\n\u{202E}ok";
        let shown = Shown(raw).to_string();
        assert_eq!(shown, "stuck\\u{1b}[1A\\u{d}key demo/x\\u{a}\\u{202e}ok");
        assert!(shown.chars().all(printable));
        assert_eq!(Shown("plain — ü").to_string(), "plain — ü");
        // a writer's literal "\u{1b}" is not shown like an escaped ESC
        assert_eq!(Shown("a\\u{1b}").to_string(), "a\\\\u{1b}");
    }

    #[test]
    fn length_is_bounded() {
        assert!(checked("", "r", 512).is_err());
        assert!(checked("   ", "r", 512).is_err());
        assert!(checked(&"x".repeat(513), "r", 512).is_err());
        assert!(checked(&"x".repeat(512), "r", 512).is_ok());
    }
}
