//! The extent store (see docs/extent-store-format.md).
