"""`kvsnap view`: an attention explorer in the browser, its data read lazily from the files named
(`data`), served on the loopback interface behind a random token (`server`), or written as one
self-contained page (`page`)."""
