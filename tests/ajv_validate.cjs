// Validates values against the checked-in JSON Schemas with ajv in its default (strict)
// mode, as a JavaScript consumer would: node ajv_validate.cjs SCHEMA_DIR VALUE.json...
// Each value is checked against event.schema.json, its own type's schema, and, for the
// types the outcomes topic carries, outcome.schema.json. Prints one line per failure.
"use strict";
const fs = require("fs");
const path = require("path");
const Ajv = require("ajv");

const [schemaDir, ...values] = process.argv.slice(2);
const ajv = new Ajv(); // strict by default: unknown keywords, formats and ambiguities are errors
// Every checked-in schema compiles (compiling throws on what strict mode refuses).
const compiled = new Map(
  fs.readdirSync(schemaDir).filter((n) => n.endsWith(".schema.json"))
    .map((n) => [n, ajv.compile(JSON.parse(fs.readFileSync(path.join(schemaDir, n), "utf8")))]),
);
const load = (name) => compiled.get(name);
const event = load("event.schema.json");
const outcome = load("outcome.schema.json");
const outcomeTypes = new Set(outcome.schema.oneOf.map((ref) => ref.$ref.split("/").pop()));
let failures = 0;
const check = (validate, value, file, against) => {
  if (!validate(value)) {
    failures += 1;
    console.log(`${file} against ${against}: ${ajv.errorsText(validate.errors)}`);
  }
};
for (const file of values) {
  const value = JSON.parse(fs.readFileSync(file, "utf8"));
  check(event, value, file, "event.schema.json");
  check(load(`${value.type}.schema.json`), value, file, `${value.type}.schema.json`);
  if (outcomeTypes.has(value.type)) check(outcome, value, file, "outcome.schema.json");
}
// A value of no known type, or missing a required field, must be refused.
const bogus = { type: "NoSuchEvent", schema_version: 1, event_id: "e", conversation_id: "c", occurred_at: 1 };
if (event(bogus)) { failures += 1; console.log("an unknown type was accepted"); }
console.log(`${compiled.size} schemas compiled, ${values.length} values checked, ${failures} failures`);
process.exit(failures ? 1 : 0);
