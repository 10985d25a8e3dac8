"""What every package needs and nothing above: the errors that end a run in one line, atomic file writes and JSON
read back, another user's links refused, a full disk named, which torch may read a pickle at all."""
