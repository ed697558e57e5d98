"""The disk tier's store: its files and directory, index, listing, quarantine, layouts, pressure."""
