//! A request's priority class: strict between classes (a person waits on an
//! interactive turn; a batch is told to back off by its deadline).

/// A request's priority class (`x-agent-serve-priority`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    Interactive,
    Normal,
    Batch,
}

impl Default for Class {
    /// What a request that names none is before the config's default applies.
    fn default() -> Class {
        Class::Normal
    }
}

impl Class {
    pub const ALL: [Class; 3] = [Class::Interactive, Class::Normal, Class::Batch];

    /// Its place in [`Class::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Class::Interactive => "interactive",
            Class::Normal => "normal",
            Class::Batch => "batch",
        }
    }

    pub fn parse(s: &str) -> Option<Class> {
        match s.trim().to_ascii_lowercase().as_str() {
            "interactive" => Some(Class::Interactive),
            "normal" => Some(Class::Normal),
            "batch" => Some(Class::Batch),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_labels_are_the_classes_in_order() {
        assert_eq!(Class::ALL.map(Class::as_str), crate::metrics::CLASS_LABELS);
        assert!(Class::ALL.iter().enumerate().all(|(i, c)| c.index() == i));
    }

    #[test]
    fn classes_parse_from_the_header() {
        assert_eq!(Class::parse(" Interactive"), Some(Class::Interactive));
        assert_eq!(Class::parse("batch"), Some(Class::Batch));
        assert_eq!(Class::parse("urgent"), None);
    }
}
