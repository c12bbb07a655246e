//! Integer shape expressions over hparam names: `n_head * head_dim`, `(n_ff_exp) * 2 - 1`.
//!
//! Grammar (whitespace ignored):
//! `expr = term (('+' | '-') term)*`, `term = unary (('*' | '/') unary)*`,
//! `unary = '-' unary | atom`, `atom = integer | name | '(' expr ')'`.
//! Division is exact: a remainder is an error, because a truncated shape would silently
//! describe the wrong tensor. Every error message quotes the whole expression.

use std::fmt;

/// A parsed expression plus the text it came from (kept for error messages and rendering).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expr {
    text: String,
    node: Node,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Node {
    Int(i64),
    Name(String),
    Neg(Box<Node>),
    Bin(Box<Node>, Op, Box<Node>),
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Add,
    Sub,
    Mul,
    Div,
}

impl Op {
    pub fn symbol(self) -> char {
        match self {
            Op::Add => '+',
            Op::Sub => '-',
            Op::Mul => '*',
            Op::Div => '/',
        }
    }
}

/// An error parsing or evaluating an expression; `Display` names the expression.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExprError {
    pub expr: String,
    pub message: String,
}

impl fmt::Display for ExprError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "expression `{}`: {}", self.expr, self.message)
    }
}

impl std::error::Error for ExprError {}

/// What a name stands for while evaluating.
#[derive(Clone, Debug, PartialEq)]
pub enum NameValue {
    Int(i64),
    /// The name exists but is not an integer (an f32 or bool hparam).
    NotInteger(&'static str),
}

impl Expr {
    /// Parses `text`.
    pub fn parse(text: &str) -> Result<Expr, ExprError> {
        let err = |message: String| ExprError {
            expr: text.to_string(),
            message,
        };
        let tokens = tokenize(text).map_err(err)?;
        if tokens.is_empty() {
            return Err(err("is empty".into()));
        }
        let mut parser = Parser {
            tokens: &tokens,
            pos: 0,
        };
        let node = parser.expr().map_err(err)?;
        if let Some(tok) = parser.tokens.get(parser.pos) {
            return Err(err(format!(
                "unexpected {} after a complete expression",
                tok.describe()
            )));
        }
        Ok(Expr {
            text: text.trim().to_string(),
            node,
        })
    }

    /// An expression that is just an integer (for shapes written as TOML integers).
    pub fn int(value: i64) -> Expr {
        Expr {
            text: value.to_string(),
            node: Node::Int(value),
        }
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn node(&self) -> &Node {
        &self.node
    }

    /// Every name the expression refers to, in order of first appearance.
    pub fn names(&self) -> Vec<&str> {
        fn walk<'a>(node: &'a Node, out: &mut Vec<&'a str>) {
            match node {
                Node::Int(_) => {}
                Node::Name(n) => {
                    if !out.contains(&n.as_str()) {
                        out.push(n);
                    }
                }
                Node::Neg(inner) => walk(inner, out),
                Node::Bin(a, _, b) => {
                    walk(a, out);
                    walk(b, out);
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.node, &mut out);
        out
    }

    /// The value if the expression is a bare name (`"n_embd"`), for presentation.
    pub fn as_name(&self) -> Option<&str> {
        match &self.node {
            Node::Name(n) => Some(n),
            _ => None,
        }
    }

    /// Evaluates with checked i64 arithmetic; `lookup` returns `None` for unknown names.
    pub fn eval(&self, lookup: &dyn Fn(&str) -> Option<NameValue>) -> Result<i64, ExprError> {
        eval_node(&self.node, lookup).map_err(|message| ExprError {
            expr: self.text.clone(),
            message,
        })
    }
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

fn eval_node(node: &Node, lookup: &dyn Fn(&str) -> Option<NameValue>) -> Result<i64, String> {
    match node {
        Node::Int(v) => Ok(*v),
        Node::Name(name) => match lookup(name) {
            Some(NameValue::Int(v)) => Ok(v),
            Some(NameValue::NotInteger(ty)) => Err(format!(
                "`{name}` is a {ty} hparam; only integers can appear in expressions"
            )),
            None => Err(format!("unknown name `{name}`")),
        },
        Node::Neg(inner) => {
            let v = eval_node(inner, lookup)?;
            v.checked_neg()
                .ok_or_else(|| format!("-({v}) overflows i64"))
        }
        Node::Bin(a, op, b) => {
            let (a, b) = (eval_node(a, lookup)?, eval_node(b, lookup)?);
            let overflow = || format!("{a} {} {b} overflows i64", op.symbol());
            match op {
                Op::Add => a.checked_add(b).ok_or_else(overflow),
                Op::Sub => a.checked_sub(b).ok_or_else(overflow),
                Op::Mul => a.checked_mul(b).ok_or_else(overflow),
                Op::Div => {
                    if b == 0 {
                        Err(format!("{a} / 0 divides by zero"))
                    } else if a % b != 0 {
                        Err(format!("{a} / {b} is not exact (remainder {})", a % b))
                    } else {
                        a.checked_div(b).ok_or_else(overflow)
                    }
                }
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
enum Token {
    Int(i64),
    Name(String),
    Op(Op),
    Open,
    Close,
}

impl Token {
    fn describe(&self) -> String {
        match self {
            Token::Int(v) => format!("integer {v}"),
            Token::Name(n) => format!("name `{n}`"),
            Token::Op(op) => format!("`{}`", op.symbol()),
            Token::Open => "`(`".into(),
            Token::Close => "`)`".into(),
        }
    }
}

fn tokenize(text: &str) -> Result<Vec<Token>, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i] as char;
        match c {
            ' ' | '\t' => i += 1,
            '+' | '-' | '*' | '/' => {
                out.push(Token::Op(match c {
                    '+' => Op::Add,
                    '-' => Op::Sub,
                    '*' => Op::Mul,
                    _ => Op::Div,
                }));
                i += 1;
            }
            '(' => {
                out.push(Token::Open);
                i += 1;
            }
            ')' => {
                out.push(Token::Close);
                i += 1;
            }
            '0'..='9' => {
                let start = i;
                while i < bytes.len() && (bytes[i].is_ascii_digit() || bytes[i] == b'_') {
                    i += 1;
                }
                let digits: String = text[start..i].chars().filter(|&c| c != '_').collect();
                let value = digits
                    .parse::<i64>()
                    .map_err(|_| format!("integer `{}` does not fit in i64", &text[start..i]))?;
                if i < bytes.len() && (bytes[i].is_ascii_alphabetic()) {
                    return Err(format!(
                        "`{}` is neither an integer nor a name",
                        &text[start..=i]
                    ));
                }
                out.push(Token::Int(value));
            }
            c if c.is_ascii_alphabetic() || c == '_' => {
                let start = i;
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                    i += 1;
                }
                out.push(Token::Name(text[start..i].to_string()));
            }
            _ => {
                let ch = text[i..].chars().next().unwrap_or('?');
                return Err(format!("unexpected character `{ch}` at offset {i}"));
            }
        }
    }
    Ok(out)
}

struct Parser<'a> {
    tokens: &'a [Token],
    pos: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.pos)
    }

    fn expr(&mut self) -> Result<Node, String> {
        let mut node = self.term()?;
        while let Some(Token::Op(op @ (Op::Add | Op::Sub))) = self.peek() {
            let op = *op;
            self.pos += 1;
            node = Node::Bin(Box::new(node), op, Box::new(self.term()?));
        }
        Ok(node)
    }

    fn term(&mut self) -> Result<Node, String> {
        let mut node = self.unary()?;
        while let Some(Token::Op(op @ (Op::Mul | Op::Div))) = self.peek() {
            let op = *op;
            self.pos += 1;
            node = Node::Bin(Box::new(node), op, Box::new(self.unary()?));
        }
        Ok(node)
    }

    fn unary(&mut self) -> Result<Node, String> {
        if let Some(Token::Op(Op::Sub)) = self.peek() {
            self.pos += 1;
            return Ok(Node::Neg(Box::new(self.unary()?)));
        }
        self.atom()
    }

    fn atom(&mut self) -> Result<Node, String> {
        let Some(tok) = self.peek().cloned() else {
            return Err("ends where a value was expected".into());
        };
        self.pos += 1;
        match tok {
            Token::Int(v) => Ok(Node::Int(v)),
            Token::Name(n) => Ok(Node::Name(n)),
            Token::Open => {
                let inner = self.expr()?;
                match self.peek() {
                    Some(Token::Close) => {
                        self.pos += 1;
                        Ok(inner)
                    }
                    Some(other) => Err(format!("expected `)` but found {}", other.describe())),
                    None => Err("unclosed `(`".into()),
                }
            }
            other => Err(format!("expected a value but found {}", other.describe())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(name: &str) -> Option<NameValue> {
        match name {
            "n_embd" => Some(NameValue::Int(6144)),
            "n_head" => Some(NameValue::Int(64)),
            "head_dim" => Some(NameValue::Int(256)),
            "rope_dim" => Some(NameValue::Int(64)),
            "zero" => Some(NameValue::Int(0)),
            "big" => Some(NameValue::Int(i64::MAX)),
            "eps" => Some(NameValue::NotInteger("f32")),
            _ => None,
        }
    }

    fn eval(text: &str) -> Result<i64, ExprError> {
        Expr::parse(text)?.eval(&vars)
    }

    #[test]
    fn precedence_associativity_and_parentheses() {
        assert_eq!(eval("n_head * head_dim").unwrap(), 16384);
        assert_eq!(eval("head_dim - rope_dim").unwrap(), 192);
        assert_eq!(eval("2 + 3 * 4").unwrap(), 14);
        assert_eq!(eval("(2 + 3) * 4").unwrap(), 20);
        assert_eq!(
            eval("100 - 10 - 1").unwrap(),
            89,
            "subtraction is left-associative"
        );
        assert_eq!(
            eval("64 / 4 / 2").unwrap(),
            8,
            "division is left-associative"
        );
        assert_eq!(eval("-rope_dim + head_dim").unwrap(), 192);
        assert_eq!(eval("  n_embd/n_head ").unwrap(), 96);
        assert_eq!(eval("1_000 * 2").unwrap(), 2000);
    }

    #[test]
    fn names_are_listed_once_in_order() {
        let e = Expr::parse("n_head * (head_dim - rope_dim) + n_head").unwrap();
        assert_eq!(e.names(), ["n_head", "head_dim", "rope_dim"]);
        assert_eq!(Expr::parse("n_embd").unwrap().as_name(), Some("n_embd"));
        assert_eq!(Expr::parse("n_embd * 1").unwrap().as_name(), None);
    }

    #[test]
    fn evaluation_errors_name_the_expression() {
        let cases = [
            ("n_embd / zero", "divides by zero"),
            ("n_embd / 5", "not exact (remainder 4)"),
            ("big * 2", "overflows"),
            ("n_layers + 1", "unknown name `n_layers`"),
            ("eps * 2", "`eps` is a f32 hparam"),
        ];
        for (text, want) in cases {
            let err = eval(text).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains(&format!("`{text}`")),
                "{msg:?} should quote {text:?}"
            );
            assert!(msg.contains(want), "{msg:?} should contain {want:?}");
        }
    }

    #[test]
    fn syntax_errors_name_the_expression() {
        let cases = [
            ("", "is empty"),
            ("n_embd *", "ends where a value was expected"),
            ("(n_embd + 1", "unclosed `(`"),
            ("n_embd + 1)", "unexpected `)`"),
            ("n_embd % 2", "unexpected character `%`"),
            ("2n", "neither an integer nor a name"),
            ("n_embd n_head", "unexpected name `n_head`"),
            ("99999999999999999999", "does not fit in i64"),
        ];
        for (text, want) in cases {
            let msg = Expr::parse(text).unwrap_err().to_string();
            assert!(msg.starts_with(&format!("expression `{text}`")), "{msg:?}");
            assert!(msg.contains(want), "{msg:?} should contain {want:?}");
        }
    }
}
