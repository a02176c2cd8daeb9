//! Stop strings matched on generated text across token boundaries. Text that could be the
//! start of a stop string is held back until it is known not to be one, so a client never
//! sees any part of a stop string.

#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    /// Feed newly decoded text. Returns the text safe to emit and whether a stop string
    /// was found (then the text is cut right before it and generation must end).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(pos) = first {
            let out = self.held[..pos].to_owned();
            self.held.clear();
            return (out, true);
        }
        (self.release_all_but_a_prefix(), false)
    }

    /// Release the held text but its longest suffix that is a proper prefix of some stop
    /// string.
    fn release_all_but_a_prefix(&mut self) -> String {
        let keep = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_owned();
        self.held.drain(..cut);
        out
    }

    /// Feed newly decoded text that may not end generation (before `min_tokens`): a stop
    /// string completed here is passed through as text; only a proper prefix of one at the
    /// end is held, since a later token may complete it. Returns the text safe to emit.
    pub fn push_unchecked(&mut self, text: &str) -> String {
        self.held.push_str(text);
        self.release_all_but_a_prefix()
    }

    /// End of generation without a stop: release what was held.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Length in bytes of the longest suffix of `text` that is a proper prefix of `stop`.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let max = text.len().min(stop.len().saturating_sub(1));
    (1..=max)
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && stop.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool, String) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut outs = Vec::new();
        for p in pieces {
            let (o, stopped) = m.push(p);
            outs.push(o);
            if stopped {
                return (outs, true, String::new());
            }
        }
        let rest = m.finish();
        (outs, false, rest)
    }

    #[test]
    fn stop_split_across_tokens_is_trimmed_and_never_leaked() {
        let (outs, stopped, _) = run(&["END"], &["abc E", "N", "D tail"]);
        assert!(stopped);
        assert_eq!(outs, vec!["abc ", "", ""]);
    }

    #[test]
    fn false_prefix_is_released_later() {
        let (outs, stopped, rest) = run(&["END"], &["x E", "Nx", "y EN"]);
        assert!(!stopped);
        assert_eq!(outs.concat() + &rest, "x ENxy EN");
        assert_eq!(outs, vec!["x ", "ENx", "y "]);
        assert_eq!(rest, "EN");
    }

    #[test]
    fn earliest_of_several_stops_wins_and_unicode_is_safe() {
        let (outs, stopped, _) = run(&["é!", "b"], &["aé", "!b"]);
        assert!(stopped);
        assert_eq!(outs.concat(), "a");
    }

    #[test]
    fn unchecked_text_passes_stops_through_but_holds_a_prefix_a_later_token_may_complete() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        // A stop string completed before min_tokens is text like any other ...
        assert_eq!(m.push_unchecked("a END b E"), "a END b ");
        // ... but a prefix of one at the end waits: completed by a checked token, it stops.
        assert_eq!(m.push("ND x"), (String::new(), true));
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push_unchecked("EN"), "");
        assert_eq!(m.push("x"), ("ENx".to_owned(), false));
    }
}
