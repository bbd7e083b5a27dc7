//! Writing and checking expert images: converting a Hugging Face checkpoint ([`convert`]), packing
//! its routed experts into a `.picchioflat` image ([`pack`]), verifying an image ([`verify`]),
//! synthetic images of seeded random payloads in a real model's expert geometry, for storage
//! experiments ([`synthetic_image`]), the image writer both share ([`write`]), random-weight converted
//! model directories for the demo ([`synthetic_model`]), re-quantizing a converted directory's
//! experts ([`transcode`]), and the model directory an image records ([`record`]).

pub mod convert;
pub mod guard;
pub mod pack;
pub mod record;
pub mod synthetic_image;
pub mod synthetic_model;
pub mod transcode;
pub mod verify;
pub mod write;
