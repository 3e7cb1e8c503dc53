"""The operator console: HTML pages at `/ui` of a worker's HTTP port (conversation list,
conversation, turn), served from the worker's state, following live over server-sent
events, with buttons that call the API's approve/deny/resume. Its CSS and JS ship in the
package (`assets/`): no CDN, no build step. `export` writes one turn's page as a file."""
