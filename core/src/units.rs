//! Sizes for people: one formatting of byte counts for every crate's messages.

/// `n` bytes in binary units with one decimal, e.g. `100 B`, `392.0 KiB`, `3.0 GiB` (up to PiB).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::human_bytes as human;

    #[test]
    fn human_sizes() {
        assert_eq!(human(100), "100 B");
        assert_eq!(human(401408), "392.0 KiB");
        assert_eq!(human(3 << 30), "3.0 GiB");
    }
}
