//! What the examples share: a `main` that runs only on Linux, where the driver and the controller
//! model exist, and reports a failure with its chain of causes.

/// Defines the example's `main`. On Linux it calls `$run` (a `fn() -> Result<(), Box<dyn Error>>`);
/// an error is printed with each of its causes (`caused by: ...`) and the exit status is 1. Elsewhere
/// it says that `$name` needs Linux and exits with status 1.
macro_rules! linux_only_main {
    ($name:literal, $run:path) => {
        #[cfg(target_os = "linux")]
        fn main() {
            if let Err(e) = $run() {
                eprintln!("Error: {e}");
                let mut src = std::error::Error::source(&*e);
                while let Some(s) = src {
                    eprintln!("  caused by: {s}");
                    src = s.source();
                }
                std::process::exit(1);
            }
        }

        #[cfg(not(target_os = "linux"))]
        fn main() {
            eprintln!(concat!($name, ": picchio-nvme's driver and controller model are Linux-only"));
            std::process::exit(1);
        }
    };
}

pub(crate) use linux_only_main;
