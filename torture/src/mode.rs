//! How a worker holds a key, as its events and the checker name it.

use tower_lock::LockMode;

/// A hold's mode: which other holds of its key it excludes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// A mutex.
    #[default]
    Exclusive,
    /// A reader of a read/write lock: shares its key with readers only.
    Read,
    /// A writer of a read/write lock.
    Write,
    /// A permit of a semaphore with this many permits.
    Semaphore(u32),
    /// One of the mutexes `lock_all` took together.
    All,
}

impl Mode {
    /// The mode it is asked for with (`lock_all` takes mutexes).
    pub fn lock_mode(self) -> LockMode {
        match self {
            Mode::Exclusive | Mode::All => LockMode::Exclusive,
            Mode::Read => LockMode::Read,
            Mode::Write => LockMode::Write,
            Mode::Semaphore(permits) => LockMode::Semaphore { permits },
        }
    }

    /// How the events write it: `x`, `r`, `w`, `s2`, `a`.
    pub fn tag(self) -> String {
        match self {
            Mode::Exclusive => "x".into(),
            Mode::Read => "r".into(),
            Mode::Write => "w".into(),
            Mode::Semaphore(permits) => format!("s{permits}"),
            Mode::All => "a".into(),
        }
    }

    pub fn parse(tag: &str) -> Option<Mode> {
        Some(match tag {
            "x" => Mode::Exclusive,
            "r" => Mode::Read,
            "w" => Mode::Write,
            "a" => Mode::All,
            _ => Mode::Semaphore(tag.strip_prefix('s')?.parse().ok()?),
        })
    }

    /// Whether a hold in this mode and one in `other`, on one key, may not
    /// overlap. Semaphore permits are counted instead ([`Mode::permits`]).
    pub fn excludes(self, other: Mode) -> bool {
        !(self == Mode::Read && other == Mode::Read)
    }

    /// How many holds of a semaphore's key may overlap.
    pub fn permits(self) -> Option<u32> {
        match self {
            Mode::Semaphore(permits) => Some(permits),
            _ => None,
        }
    }

    /// Whether its holder reads the fenced register.
    pub fn uses_register(self) -> bool {
        !matches!(self, Mode::Semaphore(_))
    }

    /// Whether its holder writes the fenced register (a reader does not).
    pub fn writes(self) -> bool {
        matches!(self, Mode::Exclusive | Mode::Write | Mode::All)
    }
}
