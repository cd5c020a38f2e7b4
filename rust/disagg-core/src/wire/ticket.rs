//! See [`crate::wire`].
