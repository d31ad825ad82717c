"""Words for people: what ``healthagent explain`` and ``healthagent classify`` print about a code, an
XID or a ConnectX event, and what the repair engines do with a verdict. At the edge: it reads the
policy's catalogs and the effects' vocabularies, and nothing below it imports it."""
