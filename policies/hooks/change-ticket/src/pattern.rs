//! The ticket pattern, compiled per call without the cost of a regex.
//!
//! Every call runs in a fresh instance, so whatever the hook compiles it
//! compiles on every Acquire. `regex_lite::Regex::new` for a typical ticket
//! pattern costs more than the rest of the hook together, so the patterns
//! tickets use — a concatenation of literals, `.`, `\d`, `\D` and bracket
//! classes of ASCII letters, digits and `_` (with ranges), each optionally
//! repeated (`?`, `*`, `+`, `{n}`, `{n,}`, `{n,m}`), optionally anchored at
//! the start (`^`) and the end (`$`) — are parsed here into a list and
//! matched in one pass per item. Any other pattern (groups, alternation,
//! flags, other escapes, lazy repetitions, non-ASCII literals, counts above
//! 1000) is handed to regex-lite as before, so the accepted syntax and its
//! meaning are regex-lite's either way; the tests check the two agree.

use regex_lite::Regex;

/// Most repetitions a fast pattern may spell out in total; above this the
/// pattern goes to regex-lite (whose size limit then applies as before).
const MAX_REPEAT: u32 = 1000;

pub enum Pattern {
    Simple(Simple),
    Regex(Regex),
}

impl Pattern {
    /// Parses `src`; the error is regex-lite's, for a pattern it refuses.
    pub fn new(src: &str) -> Result<Self, regex_lite::Error> {
        match Simple::parse(src) {
            Some(s) => Ok(Pattern::Simple(s)),
            None => Regex::new(src).map(Pattern::Regex),
        }
    }

    pub fn is_match(&self, haystack: &str) -> bool {
        match self {
            Pattern::Simple(s) => s.is_match(haystack),
            Pattern::Regex(r) => r.is_match(haystack),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Set {
    Char(char),
    /// `.`: anything but a line feed.
    Any,
    /// Inclusive ranges (ASCII), negated or not.
    Class {
        negated: bool,
        ranges: Vec<(u8, u8)>,
    },
}

impl Set {
    fn matches(&self, c: char) -> bool {
        match self {
            Set::Char(x) => *x == c,
            Set::Any => c != '\n',
            Set::Class { negated, ranges } => {
                let inside = u8::try_from(u32::from(c))
                    .is_ok_and(|b| ranges.iter().any(|(lo, hi)| (*lo..=*hi).contains(&b)));
                inside != *negated
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Item {
    set: Set,
    min: u32,
    /// `None`: unbounded.
    max: Option<u32>,
}

/// A concatenation of repeated character sets, optionally anchored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Simple {
    start: bool,
    end: bool,
    items: Vec<Item>,
}

/// Literal characters outside brackets that mean themselves in regex-lite.
fn plain(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '/' | ':' | '@' | '=' | ',')
}

/// Characters a backslash may escape to mean themselves.
fn escapable(c: char) -> bool {
    matches!(
        c,
        '\\' | '.' | '+' | '*' | '?' | '(' | ')' | '|' | '[' | ']' | '{' | '}' | '^' | '$' | '-'
    )
}

fn class_char(c: char) -> Option<u8> {
    (c.is_ascii_alphanumeric() || c == '_').then_some(c as u8)
}

impl Simple {
    /// The pattern as a [`Simple`], or `None` if it uses anything else.
    pub fn parse(src: &str) -> Option<Self> {
        let mut chars = src.chars().peekable();
        let start = chars.next_if_eq(&'^').is_some();
        let mut end = false;
        let mut items: Vec<Item> = Vec::new();
        let mut total: u32 = 0;
        while let Some(c) = chars.next() {
            if end {
                return None; // something after `$`
            }
            let set = match c {
                '$' => {
                    end = true;
                    continue;
                }
                '.' => Set::Any,
                '\\' => match chars.next()? {
                    'd' => Set::Class {
                        negated: false,
                        ranges: vec![(b'0', b'9')],
                    },
                    'D' => Set::Class {
                        negated: true,
                        ranges: vec![(b'0', b'9')],
                    },
                    e if escapable(e) => Set::Char(e),
                    _ => return None,
                },
                '[' => {
                    let negated = chars.next_if_eq(&'^').is_some();
                    let mut ranges = Vec::new();
                    loop {
                        let c = chars.next()?;
                        if c == ']' && !ranges.is_empty() {
                            break;
                        }
                        let lo = class_char(c)?;
                        let hi = if chars.next_if_eq(&'-').is_some() {
                            class_char(chars.next()?)?
                        } else {
                            lo
                        };
                        if hi < lo {
                            return None;
                        }
                        ranges.push((lo, hi));
                    }
                    Set::Class { negated, ranges }
                }
                c if plain(c) => Set::Char(c),
                _ => return None,
            };
            let (min, max) = match chars.next_if(|c| matches!(c, '?' | '*' | '+' | '{')) {
                None => (1, Some(1)),
                Some('?') => (0, Some(1)),
                Some('*') => (0, None),
                Some('+') => (1, None),
                Some(_) => {
                    let mut body = String::new();
                    loop {
                        match chars.next()? {
                            '}' => break,
                            c if c.is_ascii_digit() || c == ',' => body.push(c),
                            _ => return None,
                        }
                    }
                    let count = |s: &str| -> Option<u32> {
                        if s.is_empty() || s.len() > 4 {
                            return None;
                        }
                        s.parse::<u32>().ok().filter(|n| *n <= MAX_REPEAT)
                    };
                    let (min, max) = match body.split_once(',') {
                        None => {
                            let n = count(&body)?;
                            (n, Some(n))
                        }
                        Some((lo, "")) => (count(lo)?, None),
                        Some((lo, hi)) => (count(lo)?, Some(count(hi)?)),
                    };
                    if max.is_some_and(|m| m < min) {
                        return None;
                    }
                    (min, max)
                }
            };
            // A lazy or stacked repetition: leave it to regex-lite.
            if (min, max) != (1, Some(1)) && matches!(chars.peek(), Some('?' | '*' | '+' | '{')) {
                return None;
            }
            total = total.saturating_add(max.unwrap_or(min).max(1));
            items.push(Item { set, min, max });
        }
        (total <= MAX_REPEAT).then_some(Self { start, end, items })
    }

    /// Whether the pattern matches somewhere in `haystack` (everywhere the
    /// anchors allow), like `Regex::is_match`.
    pub fn is_match(&self, haystack: &str) -> bool {
        match self.is_match_short(haystack) {
            Some(m) => m,
            None => self.is_match_long(haystack),
        }
    }

    /// [`Simple::is_match`] for haystacks of at most 127 chars (tickets),
    /// with the reachable positions as the bits of a `u128`: no allocation,
    /// one pass over the haystack per item. `None` for a longer haystack.
    fn is_match_short(&self, haystack: &str) -> Option<bool> {
        if haystack.len() > 127 * 4 {
            return None;
        }
        let n = haystack.chars().count();
        if n > 127 {
            return None;
        }
        // Bit p: the items so far can end at char position p.
        let all: u128 = if n == 127 {
            u128::MAX
        } else {
            (1u128 << (n + 1)) - 1
        };
        let mut reach: u128 = if self.start { 1 } else { all };
        for item in &self.items {
            let mut next: u128 = 0;
            let mut run: u32 = 0;
            let mut chars = haystack.chars();
            for q in 0..=n {
                if q > 0 {
                    let ok = chars.next().is_some_and(|c| item.set.matches(c));
                    run = if ok { run + 1 } else { 0 };
                }
                // Ends at q after starting at a reachable p with
                // min <= q - p <= min(max, run).
                let longest = item.max.map_or(run, |m| m.min(run)) as usize;
                let shortest = item.min as usize;
                if longest >= shortest && q >= shortest {
                    let (lo, hi) = (q.saturating_sub(longest), q - shortest);
                    // Bits lo..=hi (hi <= 127).
                    let upto = if hi >= 127 {
                        u128::MAX
                    } else {
                        (1u128 << (hi + 1)) - 1
                    };
                    let from = !((1u128 << lo) - 1);
                    if reach & upto & from != 0 {
                        next |= 1u128 << q;
                    }
                }
            }
            reach = next;
            if reach == 0 {
                return Some(false);
            }
        }
        Some(if self.end {
            reach & (1u128 << n) != 0
        } else {
            reach != 0
        })
    }

    /// [`Simple::is_match`] for any haystack.
    fn is_match_long(&self, haystack: &str) -> bool {
        let chars: Vec<char> = haystack.chars().collect();
        let n = chars.len();
        // reach[p]: the items so far can end at char position p.
        let mut reach = vec![!self.start; n + 1];
        if let Some(first) = reach.first_mut() {
            *first = true;
        }
        let mut prefix = vec![0u32; n + 2];
        let mut run = vec![0u32; n + 1];
        for item in &self.items {
            // prefix[i]: reachable positions among 0..i.
            for p in 0..=n {
                let here = u32::from(reach.get(p).copied().unwrap_or(false));
                let before = prefix.get(p).copied().unwrap_or(0);
                if let Some(slot) = prefix.get_mut(p + 1) {
                    *slot = before + here;
                }
            }
            // run[q]: how many chars before q match the item's set in a row.
            for q in 1..=n {
                let ok = chars.get(q - 1).is_some_and(|c| item.set.matches(*c));
                let prev = run.get(q - 1).copied().unwrap_or(0);
                if let Some(slot) = run.get_mut(q) {
                    *slot = if ok { prev + 1 } else { 0 };
                }
            }
            let mut any = false;
            for q in 0..=n {
                // The item ends at q if it started at some reachable p with
                // min <= q - p <= min(max, run[q]).
                let span = run.get(q).copied().unwrap_or(0);
                let longest = item.max.map_or(span, |m| m.min(span)) as usize;
                let shortest = item.min as usize;
                let hit = longest >= shortest && q >= shortest && {
                    let lo = q.saturating_sub(longest);
                    let hi = q - shortest;
                    prefix.get(hi + 1).copied().unwrap_or(0) > prefix.get(lo).copied().unwrap_or(0)
                };
                if let Some(slot) = reach.get_mut(q) {
                    *slot = hit;
                }
                any |= hit;
            }
            if !any {
                return false;
            }
        }
        if self.end {
            reach.get(n).copied().unwrap_or(false)
        } else {
            reach.iter().any(|r| *r)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticket_patterns_are_simple() {
        for p in [
            "^CHG-[0-9]{4,10}$",
            "^CHG-[0-9]+$",
            "^CHG-[0-9]{4,}$",
            r"^(?:CHG)-\d+$",
            r"^[A-Z]{2,5}-\d{1,8}$",
            "CHG-",
            "",
            "^$",
            r"^INC\.[a-z_]*$",
        ] {
            let simple = Simple::parse(p).is_some();
            let expected = !p.contains('(');
            assert_eq!(simple, expected, "{p}");
        }
    }

    #[test]
    fn anything_else_goes_to_regex_lite() {
        for p in [
            "^(CHG|INC)-[0-9]+$",
            "^CHG-[0-9]+?$",
            r"^\w+$",
            "(?i)chg-1",
            "a{2}{3}",
            "a**",
            "[]a]",
            "[a-]",
            "[[:digit:]]",
            "^a$b",
            "a^",
            "é+",
            "x{1001}",
            "x{3,2}",
            "x{,2}",
            "x{ 2}",
            "[z-a]",
            r"\b",
        ] {
            assert!(Simple::parse(p).is_none(), "{p}");
        }
    }

    /// xorshift: the same cases on every run, no extra dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
            xs[self.below(xs.len())]
        }
    }

    fn random_pattern(rng: &mut Rng) -> String {
        let atoms = [
            "C", "H", "G", "-", "a", "0", "1", ".", r"\d", r"\D", "[0-9]", "[A-Z]", "[^0-9]",
            "[a-cG_]", r"\.", r"\-", "_", "[^C]",
        ];
        let reps = [
            "", "", "", "?", "*", "+", "{2}", "{0,1}", "{1,3}", "{2,}", "{0}", "{4,10}",
        ];
        let mut p = String::new();
        if rng.below(2) == 0 {
            p.push('^');
        }
        for _ in 0..rng.below(6) {
            p.push_str(rng.pick(&atoms));
            p.push_str(rng.pick(&reps));
        }
        if rng.below(2) == 0 {
            p.push('$');
        }
        p
    }

    fn random_haystack(rng: &mut Rng) -> String {
        let pieces = [
            "C", "H", "G", "-", "a", "b", "0", "1", "9", "\n", "é", "_", ".", "CHG-", "1234",
        ];
        (0..rng.below(12)).map(|_| rng.pick(&pieces)).collect()
    }

    #[test]
    fn simple_patterns_match_exactly_like_regex_lite() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let (mut checked, mut matched) = (0, 0);
        for _ in 0..3000 {
            let p = random_pattern(&mut rng);
            let simple = Simple::parse(&p).unwrap_or_else(|| panic!("{p:?} should be simple"));
            let re = Regex::new(&p).unwrap_or_else(|e| panic!("{p:?}: {e}"));
            for _ in 0..40 {
                let mut h = random_haystack(&mut rng);
                if rng.below(20) == 0 {
                    // Past the short path's 127 chars, and at its edge.
                    let len = if rng.below(2) == 0 { 127 } else { 200 };
                    while h.chars().count() < len {
                        h.push(if rng.below(2) == 0 { '7' } else { 'C' });
                    }
                }
                let expected = re.is_match(&h);
                assert_eq!(simple.is_match(&h), expected, "{p:?} on {h:?}");
                assert_eq!(simple.is_match_long(&h), expected, "{p:?} on {h:?}");
                checked += 1;
                matched += usize::from(expected);
            }
        }
        assert!(checked > 100_000);
        // Both answers are common, so the comparison means something.
        assert!(
            matched > checked / 10 && matched < checked * 9 / 10,
            "{matched}/{checked}"
        );
    }

    #[test]
    fn the_documented_pattern() {
        let p = Pattern::new("^CHG-[0-9]{4,10}$").unwrap();
        assert!(matches!(p, Pattern::Simple(_)));
        for (t, ok) in [
            ("CHG-1234", true),
            ("CHG-1234567890", true),
            ("CHG-123", false),
            ("CHG-12345678901", false),
            ("xCHG-1234", false),
            ("CHG-1234\n", false),
            ("CHG-12a4", false),
            ("", false),
        ] {
            assert_eq!(p.is_match(t), ok, "{t:?}");
        }
        assert!(Pattern::new("(").is_err());
        assert!(matches!(
            Pattern::new("^(CHG|INC)-[0-9]+$"),
            Ok(Pattern::Regex(_))
        ));
    }
}
