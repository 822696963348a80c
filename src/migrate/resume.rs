//! Where a migration target's time goes between the guest's state arriving and the guest's
//! release: steps marked by the start path, printed on stderr as one line when the vCPUs are
//! about to run (`vmhost: receive: the guest runs again …`).

use std::sync::Mutex;
use std::time::Instant;

/// The marks of one target, from the moment its state arrived.
#[derive(Debug)]
pub struct ResumeClock {
    marks: Mutex<Vec<(&'static str, Instant)>>,
}

impl ResumeClock {
    /// Starts the clock: the guest's state has arrived.
    pub fn start() -> ResumeClock {
        ResumeClock {
            marks: Mutex::new(vec![("state", Instant::now())]),
        }
    }

    /// Marks the end of `step`.
    pub fn mark(&self, step: &'static str) {
        self.mark_at(step, Instant::now());
    }

    /// Marks the end of `step` at `at` (a step timed by another thread).
    pub fn mark_at(&self, step: &'static str, at: Instant) {
        if let Ok(mut m) = self.marks.lock() {
            m.push((step, at));
        }
    }

    /// The whole and each step's share, in ms: "N ms after its state arrived: step a ms, …".
    pub fn line(&self) -> String {
        let Ok(marks) = self.marks.lock() else {
            return String::new();
        };
        let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1e3;
        let steps: Vec<String> = marks
            .windows(2)
            .map(|w| format!("{} {:.1} ms", w[1].0, ms(w[0].1, w[1].1)))
            .collect();
        let total = match (marks.first(), marks.last()) {
            (Some(a), Some(b)) => ms(a.1, b.1),
            _ => 0.0,
        };
        format!(
            "the guest runs again {total:.1} ms after its state arrived: {}",
            steps.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::ResumeClock;

    #[test]
    fn the_line_names_each_step_in_order_and_the_whole() {
        let c = ResumeClock::start();
        c.mark("VM built");
        c.mark_at("vCPUs", std::time::Instant::now());
        let line = c.line();
        assert!(
            line.starts_with("the guest runs again ")
                && line.contains(" ms after its state arrived: VM built "),
            "{line}"
        );
        let vm = line.find("VM built").unwrap();
        assert!(line[vm..].contains(", vCPUs "), "{line}");
    }
}
