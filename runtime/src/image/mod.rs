//! Writing and checking expert images: converting a Hugging Face checkpoint ([`convert`]), packing
//! its routed experts into a `.picchioflat` image ([`pack`]), verifying an image ([`verify`]),
//! synthetic images with a real model's geometry ([`synth`]), the image writer both share ([`write`]), random-weight models for the demo
//! ([`synthetic`]), re-quantizing a converted directory's experts ([`transcode`]), and the model
//! directory an image records ([`record`]).

pub mod convert;
pub mod guard;
pub mod pack;
pub mod record;
pub mod synth;
pub mod synthetic;
pub mod transcode;
pub mod verify;
pub mod write;
