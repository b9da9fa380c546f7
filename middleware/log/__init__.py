"""The trajectory log: segments on disk, the write-ahead log with group commit, consumer cursors, and the
stream routes. Only this package touches the log's files."""
