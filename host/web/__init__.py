"""The web terminal: a page on the proxy (xterm.js) attached to envd's /terminal, and its
signed links."""
