"""The disk tier's store: one directory of session files, its index, layouts, listing and disk-space pressure."""
