//! Writing and checking expert images: converting a Hugging Face checkpoint ([`convert`]), packing
//! its routed experts into a `.picchioflat` image ([`pack`]), verifying an image ([`verify`]),
//! synthetic images of seeded random payloads in a real model's expert geometry, for storage
//! experiments ([`synthetic_image`]), the image writer both share ([`write`]), random-weight converted
//! model directories for the demo ([`synthetic_model`]), re-quantizing a converted directory's
//! experts ([`transcode`]), the model directory an image records ([`record`]), and the expert bundle
//! of a GGUF ([`bundle`], format version 3).

pub mod bundle;
pub mod convert;
pub mod guard;
pub mod pack;
pub mod record;
pub mod synthetic_image;
pub mod synthetic_model;
pub mod transcode;
pub mod verify;
pub mod write;

/// The report line of a written directory's weight files (`convert`, `transcode`): `n` files of
/// the kind `what` (`shard`, `weight file`) holding `total_size` tensor bytes, and the other files
/// `copied` from the source.
///
/// # Errors
/// The formatter's.
pub(crate) fn fmt_files(
    f: &mut std::fmt::Formatter<'_>,
    n: usize,
    what: &str,
    total_size: u64,
    copied: &[String],
) -> std::fmt::Result {
    writeln!(f, "  {n} {what}(s), {total_size} tensor bytes; copied {}", copied.join(", "))
}

/// Runs `write_all` on a pool of `threads` rayon threads (at least 1), or on the global pool when
/// `None`, and returns the threads it ran on with its result. `what` names the job in errors
/// (`conversion`, `transcoding`).
///
/// # Errors
/// [`crate::Error::ThreadPool`] when the pool cannot be built; `write_all`'s own.
pub(crate) fn on_threads(
    threads: Option<usize>,
    what: &'static str,
    write_all: impl FnOnce() -> crate::Result<()> + Send,
) -> crate::Result<usize> {
    let run = || write_all().map(|()| rayon::current_num_threads());
    match threads {
        Some(n) => rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build()
            .map_err(|cause| crate::Error::ThreadPool { threads: n, what, cause })?
            .install(run),
        None => run(),
    }
}
